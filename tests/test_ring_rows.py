"""RingRows: conversations that are not in lockstep, decoded by one step, each exactly as its own cache.

The reference for each conversation is its own eager :class:`~kvlab.hf.RollingCache` fed the same tokens
one at a time. Conversations join the rows from an eager cache and leave back into one at different steps,
pin different numbers of sinks (a server's system prompts), roll and re-base at their own times; every
step's logits of every row agree with the reference to fp32 rounding, and a conversation that left
continues eagerly as if it had never been in the rows.
"""

from __future__ import annotations

import pytest
import torch

from kvlab.errors import BadInputError
from kvlab.hf.graphs import RollingDecoder
from kvlab.hf.ring_rows import RingRows
from kvlab.hf.rolling_cache import RollingCache
from tests.test_static_rolling import DEVICES, LOGIT_TOL, _ids, _model

WINDOW, CHUNK = 40, 8


def _conversation(h, sinks: int, prompt: torch.Tensor) -> tuple[RollingCache, RollingCache]:
    """Two equal eager caches after ``prompt``: the reference, and the one that joins the rows."""
    pair = []
    for _ in range(2):
        c = RollingCache(h.config, h.rope, window=WINDOW, sinks=sinks, evict_chunk=CHUNK)
        h.run(prompt, c, logits_to_keep=1)
        pair.append(c)
    return pair[0], pair[1]


def _pool(h, rows: int = 4) -> RingRows:
    from kvlab.hf.rolling_cache import roll_rule
    from kvlab.rope.layers import text_config

    rule = roll_rule(text_config(h.config), h.rope, WINDOW, 4, CHUNK, h.max_positions, "auto")
    return RingRows(h.config, rule, rows=rows, most_sinks=12, dtype=h.dtype, device=h.device)


def _run(mode: str, tiny_model, device: str = "cpu", family: str | None = None) -> tuple[float, dict]:
    """Three conversations (4, 9 and 12 sinks) joining at steps 0, 0 and 30; the first leaves at 60 and
    goes on eagerly; 220 steps in all (rolls every 8 tokens, re-bases at the maximum position 256).
    Returns the worst logit difference and the conversations' counts."""
    h = _model(family, device, tiny_model, max_positions=256)
    pool = _pool(h)
    dec = RollingDecoder(h, pool, mode=mode)
    convs = {}
    for name, sinks, n, seed in (("a", 4, 20, 1), ("b", 9, 37, 2), ("c", 12, 5, 3)):
        ids = _ids(n + 260, seed=seed).to(device)
        ref, mine = _conversation(h, sinks, ids[:n])
        convs[name] = {"ids": ids, "at": n, "ref": ref, "mine": mine, "row": None}
    worst, widths = 0.0, []
    for step in range(220):
        if step == 0:
            for name in ("a", "b"):
                convs[name]["row"] = pool.join(convs[name]["mine"])
        if step == 30:
            convs["c"]["row"] = pool.join(convs["c"]["mine"])
        for at, name in ((60, "a"), (150, "c")):  # they leave and go on eagerly
            if step == at:
                pool.leave(convs[name]["row"], into=convs[name]["mine"])
                convs[name]["row"], convs[name]["left"] = None, True
        rows = [c for c in convs.values() if c["row"] is not None]
        pool.feeding = [c["row"] for c in rows]
        tokens = torch.zeros(pool.batch, dtype=torch.long, device=device)
        for c in rows:
            tokens[c["row"]] = c["ids"][c["at"]]
        logits = dec.feed(tokens)
        widths.append(pool.width)
        for c in convs.values():
            if c["row"] is None and not c.get("left"):
                continue
            tok = c["ids"][c["at"] : c["at"] + 1]
            want = h.run(tok, c["ref"], logits_to_keep=1).logits[0, -1].float()
            got = (
                logits[c["row"]]
                if c["row"] is not None
                else h.run(tok, c["mine"], logits_to_keep=1).logits[0, -1]
            )
            worst = max(worst, float((want - got.float()).abs().max()))
            c["at"] += 1
    counts = {}
    for name, c in convs.items():
        state = c["mine"] if c["row"] is None else pool.row(c["row"])
        counts[name] = (c["ref"].rolls, c["ref"].rebases, c["ref"].next_position, state.evictions)
        assert (state.rolls, state.rebases, state.next_position) == counts[name][:3], name
    # rows 0 and 1 take a step of 2 rows; row 2 joining widens it to 4; rows 0 and 2 leaving narrow it to 2
    assert widths == [2] * 30 + [4] * 120 + [2] * 70
    return worst, counts


@pytest.mark.parametrize("device", DEVICES)
def test_rows_decode_each_conversation_as_its_own_eager_cache(device, tiny_model, one_torch_thread):
    worst, counts = _run("eager", tiny_model, device)
    assert worst < LOGIT_TOL
    assert all(rolls > 10 for rolls, _, _, _ in counts.values()), counts
    assert counts["a"][1] >= 1 and counts["b"][1] >= 1, counts  # re-based (a after it left)


@pytest.mark.parametrize("family", ["qwen2", "phi", "smollm3"])  # mistral, phi3: sliding windows, refused
def test_every_family_attends_the_new_token_the_step_writes_after_it(family, tiny_model, one_torch_thread):
    """On a CPU a step's new K/V reach attention only through kvlab's attention function (they are written
    after the step): a family whose attention bypassed it would miss its own token. Eager; the compiled
    step runs the same function."""
    worst, _ = _run("eager", tiny_model, "cpu", family)
    assert worst < LOGIT_TOL


@pytest.mark.slow
def test_compiled_rows_equal_eager_in_one_graph(tiny_model, one_torch_thread):
    """torch.compile(fullgraph=True) over the rows' step: conversations joining and leaving, rolling and
    re-basing change host state only, so one graph per width (2 and 4 rows) serves all 220 steps."""
    import torch._dynamo

    torch._dynamo.utils.counters.clear()
    worst, _ = _run("compile", tiny_model)
    assert worst < LOGIT_TOL
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2
    assert not torch._dynamo.utils.counters["graph_break"]


if torch.cuda.is_available():  # defined only where it can run (a skipped test fails `make test`)

    def test_cuda_graph_rows_equal_eager(tiny_model):
        """The rows' step captured as one CUDA graph: conversations joining and leaving, rolling and
        re-basing between replays, each within fp32 rounding of its own eager cache."""
        worst, _ = _run("cuda-graph", tiny_model, "cuda")
        assert worst < LOGIT_TOL


def test_the_written_back_cache_equals_the_eager_one(tiny_model, one_torch_thread):
    """join then leave with no step between: the eager cache comes back holding the same slots, counts and
    pending roll (a conversation stopped right after its prompt)."""
    h = _model(None, "cpu", tiny_model, max_positions=4096)
    ids = _ids(60)
    ref, mine = _conversation(h, 4, ids[:30])
    for t in range(30, 60):  # one token at a time until a roll is planned (44 slots held, chunk 8)
        for c in (ref, mine):
            h.run(ids[t : t + 1], c, logits_to_keep=1)
        if ref.plan.pending:
            break
    assert ref.plan.pending
    pool = _pool(h)
    pool.leave(pool.join(mine), into=mine)
    for (k1, v1), (k2, v2) in zip(ref.kept_layers(), mine.kept_layers(), strict=True):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)
    # the pending roll was applied on the way in (and counted: the reference counts it at its next update)
    assert (mine.rolls, mine.plan.pending, mine.next_position) == (ref.rolls + 1, False, ref.next_position)
    a, b = (h.run(ids[t + 1 : t + 2], c, logits_to_keep=1).logits for c in (ref, mine))
    assert torch.equal(a, b)
    assert (mine.rolls, mine.kept, mine.next_position) == (ref.rolls, ref.kept, ref.next_position)


@pytest.mark.parametrize("mode", ["eager", pytest.param("compile", marks=pytest.mark.slow)])
def test_one_conversation_takes_a_one_row_step(mode, tiny_model, one_torch_thread):
    """Four rows, one conversation (row 0): each step computes one row, and its logits are the eager
    cache's; a second conversation widens the step to two rows (its first step is exact too)."""
    h = _model(None, "cpu", tiny_model, max_positions=4096)
    pool = _pool(h)
    dec = RollingDecoder(h, pool, mode=mode)
    ids = _ids(80, seed=5)
    ref, mine = _conversation(h, 4, ids[:20])
    pool.feeding = [pool.join(mine)]
    for t in range(20, 60):
        tokens = torch.zeros(pool.batch, dtype=torch.long)
        tokens[0] = ids[t]
        got = dec.feed(tokens)
        want = h.run(ids[t : t + 1], ref, logits_to_keep=1).logits[:, -1].float()
        assert pool.width == 1 and got.shape == want.shape
        torch.testing.assert_close(got, want, atol=LOGIT_TOL, rtol=0)
    ref2, other = _conversation(h, 9, ids[:30])
    pool.feeding = [0, pool.join(other)]
    tokens = torch.tensor([ids[60], ids[30], 0, 0])
    got = dec.feed(tokens)
    assert pool.width == 2 and got.shape[0] == 2
    for row, (tok, cache) in enumerate(((ids[60:61], ref), (ids[30:31], ref2))):
        want = h.run(tok, cache, logits_to_keep=1).logits[0, -1].float()
        torch.testing.assert_close(got[row], want, atol=LOGIT_TOL, rtol=0)


def test_refusals(tiny_model):
    h = _model(None, "cpu", tiny_model, max_positions=4096)
    pool = _pool(h, rows=1)
    _, wide = _conversation(h, 13, _ids(20))  # 13 sinks: past the rows' 12
    with pytest.raises(BadInputError, match="does not fit"):
        pool.join(wide)
    _, a = _conversation(h, 4, _ids(20))
    _, b = _conversation(h, 4, _ids(20))
    r = pool.join(a)
    with pytest.raises(BadInputError, match="taken"):
        pool.join(b)
    with pytest.raises(BadInputError, match="holds no conversation"):
        pool.row(r + 1)
    pool.feeding = [r]
    with pytest.raises(BadInputError, match="one token per row"):
        pool.prepare(2)
