"""`kvlab serve --device cuda` answers the `openai` client, and says what the CPU server says.

Builds a small random-weight Llama with the bundled model's tokenizer (``TOKENIZER_DIR``: a folder
with ``tokenizer.json`` and the bundled model's ``config.json``), starts one server per target (each a
subprocess on 127.0.0.1): on CPU, on CUDA, and on CUDA with its decode steps captured as CUDA graphs
(``cuda+cuda-graph``: ``--device cuda --capture cuda-graph``), sends each the same greedy chat (two
turns, the second continuing the first's cache) plus a streamed request, and prints the replies and the
seconds each conversation took side by side. Exit 1 if a CUDA server fails to answer; token-for-token
agreement is reported, not required (fp32 everywhere, but different kernels may break a near-tie).

    python scripts/gpu_serve_check.py TOKENIZER_DIR [--devices cpu,cuda,cuda+cuda-graph]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path


def build_model(tok: Path, out: Path) -> None:
    import torch
    from transformers import AutoConfig, LlamaForCausalLM

    from kvlab.model.random import shrink_config

    cfg = shrink_config(AutoConfig.from_pretrained(tok), layers=2, head_dim=16, vocab=49152)
    cfg.initializer_range = 0.5  # larger random weights: varied tokens, not one repeated newline
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if (tok / name).exists():
            shutil.copy(tok / name, out / name)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(model: Path, target: str) -> tuple[subprocess.Popen, str]:
    device, _, capture = target.partition("+")
    port = free_port()
    log = open(Path(tempfile.gettempdir()) / f"kvlab-serve-{device.replace(':', '')}.log", "w")  # noqa: SIM115
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvlab",
            "serve",
            "--model",
            str(model),
            "--device",
            device,
            "--port",
            str(port),
            "--capture",
            capture or "off",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    url = f"http://127.0.0.1:{port}"
    for _ in range(1200):  # a captured step is built before the server listens
        if proc.poll() is not None:
            tail = Path(log.name).read_text(errors="replace").splitlines()[-25:]
            raise RuntimeError(f"kvlab serve {target} exited with {proc.returncode}:\n" + "\n".join(tail))
        try:
            with urllib.request.urlopen(url + "/health", timeout=1) as r:
                if r.status == 200:
                    return proc, url
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"kvlab serve {target} did not answer /health in 600 s")


def converse(url: str) -> dict:
    from openai import OpenAI

    client = OpenAI(base_url=url + "/v1", api_key="none")
    model = client.models.list().data[0].id
    msgs = [{"role": "user", "content": "Tell me about the key-value cache of a transformer."}]
    first = client.chat.completions.create(model=model, messages=msgs, max_tokens=24, temperature=0)
    msgs += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "And how does a rolling window keep it bounded?"},
    ]
    second = client.chat.completions.create(model=model, messages=msgs, max_tokens=24, temperature=0)
    stream = client.chat.completions.create(
        model=model, messages=msgs[:1], max_tokens=16, temperature=0, stream=True
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
        metrics = r.read().decode()
    reused = [ln for ln in metrics.splitlines() if "reused" in ln and not ln.startswith("#")]
    return {
        "first": first.choices[0].message.content,
        "second": second.choices[0].message.content,
        "streamed": streamed,
        "usage_second": second.usage.model_dump() if second.usage else None,
        "reuse_metrics": reused[:4],
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("tokenizer_dir", type=Path)
    ap.add_argument("--devices", default="cpu,cuda,cuda+cuda-graph")
    args = ap.parse_args()
    model = Path(tempfile.mkdtemp(prefix="kvlab-tiny-serve-"))
    build_model(args.tokenizer_dir, model)
    results, failed = {}, False
    for device in args.devices.split(","):
        proc = None
        try:
            proc, url = serve(model, device)
            t0 = time.perf_counter()
            results[device] = converse(url)
            results[device]["seconds"] = round(time.perf_counter() - t0, 3)
        except Exception as exc:
            results[device] = {"error": f"{type(exc).__name__}: {exc}"}
            failed = failed or device.startswith("cuda")
        finally:
            if proc is not None:
                proc.terminate()
                proc.wait(timeout=30)
    for d, r in results.items():
        if "error" in r:
            print(f"--- {d}: {r['error']}")
    print(json.dumps(results, indent=1))
    devs = [d for d in results if "error" not in results[d]]
    for other in devs[1:]:
        a, b = results[devs[0]], results[other]
        same = all(a[k] == b[k] for k in ("first", "second", "streamed"))
        print(
            f"serve {devs[0]} vs {other}: replies identical: {same}; seconds {a['seconds']} vs {b['seconds']}"
        )
    print("serve check:", "FAILED" if failed else "ok")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
