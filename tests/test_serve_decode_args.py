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
        "Serve decode vs llama-server, 512-token replies | **1.25x** at 1 conv (llama / kvlab 0.80x [0.75, 0.85]; 1.25x at 4)"
        in long
    )
    assert "Serve decode vs llama-server, 1 thread |" in serve_decode.summary_block(got, 5, "abc1234")
    assert serve_decode.parse_args(["--name", "serve_decode_512", "--no-write"]).name == "serve_decode_512"
