"""The quantized derivative: the transplant's second model on a fresh clone (no fine-tuned derivative)."""

from __future__ import annotations

import torch

from kvlab.model.derivative import QUANT_BITS, QUANT_GROUP, quantized_derivative
from kvlab.model.handle import decoder_layers
from kvlab.ops.crossmodel import transplant


def _linears(handle) -> dict[str, torch.Tensor]:
    return {
        f"{i}.{name}": sub.weight
        for i, layer in enumerate(decoder_layers(handle.model))
        for name, sub in layer.named_modules()
        if isinstance(sub, torch.nn.Linear)
    }


def test_quantized_derivative_rounds_every_decoder_weight_and_nothing_else(tiny_model):
    base = tiny_model("llama")
    before = {k: v.clone() for k, v in base.model.state_dict().items()}
    deriv = quantized_derivative(base)
    after = base.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # the base is untouched
    assert deriv.facts.num_layers == base.facts.num_layers and deriv.facts.head_dim == base.facts.head_dim
    assert deriv.tokenizer is base.tokenizer and f"{QUANT_BITS}-bit weights" in deriv.name
    lin_b, lin_d = _linears(base), _linears(deriv)
    assert lin_b and lin_b.keys() == lin_d.keys()
    qmax = 2 ** (QUANT_BITS - 1) - 1
    for k, w in lin_b.items():
        q = lin_d[k]
        assert not torch.equal(w, q), k
        groups, qgroups = w.reshape(-1, QUANT_GROUP), q.reshape(-1, QUANT_GROUP)
        step = groups.abs().amax(-1, keepdim=True) / qmax
        # round to nearest: within half a step of its group (the fp16 scale is rounded up: + 0.2%)
        assert ((groups - qgroups).abs() <= step * 0.502 + 1e-8).all(), k
        # and on the grid: every weight is a whole number of its group's scale
        codes = qgroups / qgroups.abs().amax(-1, keepdim=True) * qmax
        assert torch.allclose(codes, codes.round(), atol=1e-3), k
    for name in ("model.embed_tokens.weight", "model.norm.weight"):
        assert torch.equal(deriv.model.state_dict()[name], before[name])
    # deterministic, and a different model: its cache differs from the base's, yet transplants
    again = quantized_derivative(base)
    assert all(torch.equal(lin_d[k], v) for k, v in _linears(again).items())
    ids = list(range(5, 40))
    snap_b, snap_d = base.prefill(ids).snapshot, deriv.prefill(ids).snapshot
    assert not torch.allclose(snap_b.keys[0], snap_d.keys[0])
    moved = transplant(snap_d, deriv, base)
    out = base.extend(moved, [41, 42])
    assert out.logits.shape[0] == 2 and torch.isfinite(out.logits).all()
