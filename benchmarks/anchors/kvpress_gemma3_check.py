"""Does kvpress run a text-only Gemma-3 (``Gemma3ForCausalLM``, as Gemma-3-270M loads)? A check, not a benchmark.

Run in the anchors environment (kvpress installed):
``benchmarks/out/anchors-venv/bin/python benchmarks/anchors/kvpress_gemma3_check.py [--press knorm] [--model DIR]``.
A tiny random Gemma-3 (the tests' config: one layer with a sliding window of 64, one full layer; or the model
in ``--model``, e.g. Gemma-3-270M's folder) prefills ``--tokens`` random ids under ``with press(model):``,
kvpress's own way, and then takes one more forward (a question of 4 tokens, then a single token), as kvpress's
pipeline and the eval's worker do. Prints what each layer holds and sees, and each forward's outcome; exits 1
when a forward fails.

kvpress 0.5.5 skips sliding layers for ``Gemma3ForConditionalGeneration`` only; on ``Gemma3ForCausalLM`` it
compresses them too, and transformers' ``DynamicSlidingWindowLayer`` keeps counting the tokens it saw
(all of them), so the next forward builds its sliding mask for more keys than the layer holds.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path

import torch

CONFIG = (
    Path(__file__).resolve().parents[2]
    / "tests"
    / "fixtures"
    / "model-configs"
    / "gemma-3-tiny-hybrid-rope.json"
)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--press", default="knorm", help="a worker press name (anchor_worker.make_press)")
    ap.add_argument("--ratio", type=float, default=0.5)
    ap.add_argument("--model", default=None, help="a model folder (default: a tiny random Gemma-3)")
    ap.add_argument(
        "--tokens", type=int, default=None, help="context length (default: 100 tiny, 1024 --model)"
    )
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    import transformers
    from transformers import AutoModelForCausalLM, DynamicCache, Gemma3TextConfig

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import anchor_worker

    transformers.utils.logging.disable_progress_bar()
    if args.model:
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    else:
        raw = json.loads(CONFIG.read_text())
        items = {k: v for k, v in raw.items() if not k.startswith("_") and k != "transformers_version"}
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(Gemma3TextConfig(**items)).eval()
    n_ctx = args.tokens or (1024 if args.model else 100)
    press = anchor_worker.make_press(args.press, args.ratio)
    cache = DynamicCache(config=model.config)
    with torch.no_grad(), press(model):
        model.model(input_ids=torch.randint(3, 500, (1, n_ctx)), past_key_values=cache)
    print(f"transformers {transformers.__version__}, {type(model).__name__}, {args.press} at {args.ratio}")
    print("  slots held per layer:", [int(layer.keys.shape[-2]) for layer in cache.layers])
    print("  tokens seen per layer:", [layer.get_seq_length() for layer in cache.layers])
    failed = False
    for n, start in ((4, n_ctx), (1, n_ctx + 4)):
        try:
            with torch.no_grad():
                model(
                    input_ids=torch.randint(3, 500, (1, n)),
                    past_key_values=cache,
                    position_ids=torch.arange(start, start + n)[None],
                )
            print(f"  a {n}-token forward after the press: ok")
        except Exception as exc:  # the outcome is the answer
            failed = True
            print(f"  a {n}-token forward after the press: {type(exc).__name__}: {str(exc)[:100]}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
