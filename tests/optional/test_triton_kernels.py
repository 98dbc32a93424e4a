"""kvlab's Triton kernels compile for a Hopper GPU with the argument types every caller gives them, on a
machine with no GPU (run with ``make test-optional``, which installs Triton, the ``gpu`` extra; here a
missing Triton fails, as a missing Gemma does in test_gemma.py).

Triton's own launcher types a Python float argument as fp32, but ``torch.compile`` (inductor, calling the
kernel from a compiled graph) types it as fp64: the split-attention kernel's running maximum then turned
fp64 inside its loop and the compile failed (``Loop-carried variable m_i ... fp64``), seen on an H100 in
``benchmarks/gpu.py``'s ``torch.compile`` rows. The front end that raised it runs here, without a device.
"""

from __future__ import annotations

import importlib.util

import pytest


@pytest.fixture(scope="module", autouse=True)
def _triton_present():
    assert importlib.util.find_spec("triton"), "Triton is not installed: pip install 'triton>=3.1,<4'"


@pytest.mark.parametrize("scale", ["fp32", "fp64"])  # fp32: Triton's launcher; fp64: torch.compile
@pytest.mark.parametrize(("dtype", "precision"), [("fp32", "ieee"), ("bf16", "tf32"), ("fp16", "tf32")])
@pytest.mark.parametrize(("block_r", "head_dim"), [(16, 128), (64, 64)])
def test_split_attention_compiles_for_sm90(scale, dtype, precision, block_r, head_dim):
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kvlab.kernels import split_attention as sa

    kernel = sa._build(triton, tl)
    sig = {name: f"*{dtype}" for name in ("Q", "K", "V", "MASK")}
    sig.update({name: "*fp32" for name in ("ACC", "M", "L")})
    ints = ("sqb", "sqh", "sqr", "skb", "skh", "skc", "svb", "svh", "svc", "smb", "smr")
    sig.update({name: "i32" for name in (*ints, "H", "R", "N_TOK", "C", "CHUNK", "S")})
    constexprs = {
        "BLOCK_R": block_r,
        "BLOCK_N": sa.BLOCK_N,
        "BLOCK_D": head_dim,
        "D": head_dim,
        "PRECISION": precision,
    }
    sig.update({"scale": scale, **dict.fromkeys(constexprs, "constexpr")})
    compiled = triton.compile(ASTSource(kernel, sig, constexprs=constexprs), target=GPUTarget("cuda", 90, 32))
    assert "split_kernel" in compiled.asm["ttir"]
