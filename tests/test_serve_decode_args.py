"""``benchmarks/serve_decode.py`` refuses a bad command line in one line, before any server starts; its
``--before`` (a fourth server at another commit, paired round by round) names a commit of this repository."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import serve_decode  # noqa: E402
from _common import Refusal  # noqa: E402

pytestmark = pytest.mark.process  # parse_args asks git (a subprocess) whether a commit exists


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--before", "no-such-commit"], "--before 'no-such-commit' is not a commit"),
        (["--kvlab-commit", "no-such-commit"], "--kvlab-commit 'no-such-commit' is not a commit"),
        (["--working-tree", "--kvlab-commit", "HEAD~1"], "exclude each other"),
        (["--rounds", "3"], "--rounds >= 5"),
        (["--llama-server", "/bin/true"], "go together"),
        (["--name", "../BENCHMARKS"], "--name must be serve_decode"),
        (["--name", "other"], "--name must be serve_decode"),
    ],
)
def test_a_bad_command_line_is_refused(argv, says):
    with pytest.raises(Refusal, match=says):
        serve_decode.parse_args(argv)


def test_before_takes_a_commit_and_pairs_compile_with_it():
    args = serve_decode.parse_args(["--before", "HEAD", "--no-write", "--rounds", "1"])
    assert args.before == "HEAD" and args.kvlab_commit == "HEAD"
    rows = [
        {
            k: {"d1": d, "d4_sum": d, "d4_agg": d, "ttft_ms": 100.0}
            for k, d in (("compile", 2.0), ("before", 1.0))
        }
        for _ in range(5)
    ]
    lines, got = serve_decode.ratio_table(rows, ["compile", "before"])
    assert got[("compile", "before", "d1")]["geo"] == pytest.approx(2.0)
    assert any("kvlab-compile / kvlab-compile at --before" in line for line in lines)


def test_a_named_run_writes_its_own_row_naming_the_reply_length():
    got = {
        ("llama", k, d): {"geo": 0.8, "lo": 0.75, "hi": 0.85}
        for k in ("compile", "off")
        for d in ("d1", "d4_sum")
    }
    long = serve_decode.summary_block(got, 5, "abc1234", max_tokens=512)
    assert (
        "Serve decode vs llama-server, 512-token replies | **1.25x** at 1 conv (llama / kvlab 0.80x [0.75, 0.85]: "
        "clear of 1, kvlab ahead; 1.25x at 4, llama / kvlab 0.80x [0.75, 0.85])" in long
    )
    assert "Serve decode vs llama-server, 1 thread |" in serve_decode.summary_block(got, 5, "abc1234")
    # the status: current only where the interval shows kvlab ahead (HEAD: src/ not changed since)
    assert "| HEAD | current |" in serve_decode.summary_block(got, 5, "HEAD")
    got[("llama", "compile", "d1")] = {"geo": 0.98, "lo": 0.9, "hi": 1.06}  # kvlab ahead, interval holding 1
    assert "| HEAD | bar not met |" in serve_decode.summary_block(got, 5, "HEAD")
    assert serve_decode.parse_args(["--name", "serve_decode_512", "--no-write"]).name == "serve_decode_512"


@pytest.mark.parametrize(
    ("lo", "hi", "says"),
    [(0.9, 0.99, ": clear of 1, kvlab ahead"), (0.95, 1.05, ": holds 1, so not shown"),
     (1.01, 1.2, ": clear of 1, llama-server ahead"), (None, None, "")],
)  # fmt: skip
def test_the_row_says_whether_its_interval_shows_the_bar(lo, hi, says):
    assert serve_decode.shown({"geo": 1.0, "lo": lo, "hi": hi}) == says


def test_a_round_measures_each_thing_on_every_server_before_the_next(monkeypatch):
    """Prefill on every server, then one conversation's decode there and back (A B C C B A, two replies
    pooled per server), then four conversations on every server, each right after a warm-up reply of
    its own server: the log of who was asked what, in order."""
    asked: list[tuple[str, str]] = []
    clock = iter(range(10_000))

    def stream(server, messages, max_tokens):
        what = {1: "prefill", serve_decode.WARM_TOKENS: "warm"}.get(max_tokens, "one")
        asked.append((server.key, what))
        t = float(next(clock))
        span = 2.0 if server.key == "a" and len([x for x in asked if x == ("a", "one")]) == 2 else 1.0
        return {"sent": t, "first": t, "last": t + span, "tokens": 11, "chunks": 11, "prompt": 7}

    def together(server, prompts, max_tokens):
        asked.append((server.key, "four"))
        reply = {"sent": 0.0, "first": 0.0, "last": 1.0, "tokens": 5, "chunks": 5, "prompt": 7}
        return [reply] * len(prompts)

    monkeypatch.setattr(serve_decode, "stream", stream)
    monkeypatch.setattr(serve_decode, "together", together)
    servers = [serve_decode.Server(k, k, 0) for k in ("a", "b", "c")]
    got = serve_decode.one_round(servers, 1, "passage", 11)
    measured = [x for x in asked if x[1] != "warm"]
    assert measured == [
        ("a", "prefill"), ("b", "prefill"), ("c", "prefill"),
        ("a", "one"), ("b", "one"), ("c", "one"), ("c", "one"), ("b", "one"), ("a", "one"),
        ("a", "four"), ("b", "four"), ("c", "four"),
    ]  # fmt: skip
    # every measurement right after a warm-up reply of its own server
    assert all(asked[i - 1] == (key, "warm") for i, (key, what) in enumerate(asked) if what != "warm")
    assert len(asked) == 2 * len(measured)
    assert got["b"]["d1"] == pytest.approx(10.0)  # two replies of 10 tokens after the first, 1 s each
    assert got["a"]["d1"] == pytest.approx(20 / 3)  # pooled: 20 tokens over 1 s + 2 s, not the mean rate
    assert got["a"]["d1_rates"] == pytest.approx([10.0, 5.0])
    assert got["c"]["d4_sum"] == pytest.approx(16.0) and got["c"]["d4_agg"] == pytest.approx(19.0)
