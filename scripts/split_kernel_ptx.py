"""Static counts of the split-KV kernel's PTX for an H100 (sm_90), on a machine without a GPU: how much
code one launch shape compiles to with the mask read as tiles and with the positions rule (``POSITIONS``).
A proxy for the work per block of keys, not a timing (``benchmarks/gpu.py``'s ``split_launch`` times both).

    python scripts/split_kernel_ptx.py            # needs Triton: pip install 'triton>=3.1,<4'
"""

from __future__ import annotations

import re

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kvlab.kernels import _split_triton as kernels


def ptx(positions: bool, int4: bool, rows: int, warps: int, stages: int) -> str:
    sig = kernels.split_signature("bf16", int4, positions)
    constexprs = {
        "BLOCK_R": rows, "BLOCK_N": 64, "BLOCK_D": 128, "D": 128, "PRECISION": "tf32", "INT4": int4,
        "GROUP": 32, "BROADCAST": int4, "G": 4, "POSITIONS": positions,
    }  # fmt: skip
    sig.update(dict.fromkeys(constexprs, "constexpr"))
    src = ASTSource(kernels.split_kernel, sig, constexprs=constexprs)
    opts = {"num_warps": warps, "num_stages": stages}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts).asm["ptx"]


def main() -> None:
    print("| launch | codec | visibility | PTX lines | ld.global | wgmma | ex2 |")
    print("|---|---|---|---:|---:|---:|---:|")
    for kind, (rows, warps, stages) in (("chunk", (128, 8, 2)), ("decode", (16, 4, 2))):
        for int4 in (False, True):
            for positions in (False, True):
                text = ptx(positions, int4, rows, warps, stages)
                counts = [
                    len(re.findall(p, text)) for p in (r"ld\.global", r"wgmma\.mma_async", r"ex2\.approx")
                ]
                print(
                    f"| {kind} {rows}x{warps}x{stages} | {'int4' if int4 else 'bf16'} | "
                    f"{'positions' if positions else 'mask tiles'} | {len(text.splitlines()):,} | "
                    + " | ".join(map(str, counts))
                    + " |"
                )


if __name__ == "__main__":
    main()
