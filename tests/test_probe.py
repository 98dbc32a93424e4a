"""``kvlab probe URL`` (issue 49 item 3) against servers whose caching is known: ``kvlab serve`` on a tiny
random model (clean), and fakes that plant one fault each (``tests/probe_fakes.py``): a warm repeat
answered wrong (a correctness finding), one cache for every tenant (an isolation finding), and a correct
per-tenant cache (clean). Bad input exits 2 with one line before any request. Each run is the command
line in this process (``kvlab.cli.main``), its report read back from ``--json`` and from ``--out``.
"""

from __future__ import annotations

import json

import pytest

from tests.probe_fakes import FakeServer
from tests.test_cheap_paths import run_cli
from tests.test_serve import KEY_A, KEY_B, Server
from tests.tiny_serve import build_tiny_model

pytestmark = pytest.mark.process

#: small enough for a fake to answer in milliseconds; 6 trials a side: the smallest exact one-sided
#: Mann-Whitney p is 1/924, far below the default alpha (0.01)
QUICK = ["--trials", "6", "--prefix-words", "64", "--max-tokens", "4"]


def probe(capsys, url: str, tmp_path, *args: str) -> tuple[int, dict]:
    from kvlab.cli import main

    code = main(["probe", url, "--json", "--out", str(tmp_path / "report"), *args])
    report = json.loads(capsys.readouterr().out)
    assert json.loads((tmp_path / "report" / "report.json").read_text()) == report
    page = (tmp_path / "report" / "report.html").read_text()
    assert "<h2>Verdicts</h2>" in page and all(s["title"] in page for s in report["sections"])
    return code, report


def verdicts(report: dict) -> dict[str, str]:
    return {s["key"]: s["verdict"] for s in report["sections"]}


@pytest.fixture
def fake(request):
    server = FakeServer(request.param)
    yield server
    server.stop()


@pytest.mark.parametrize("fake", ["wrong"], indirect=True)
def test_a_wrong_warm_answer_is_a_finding(fake, tmp_path, capsys):
    code, report = probe(capsys, fake.url, tmp_path, "--api-key", KEY_A, *QUICK)
    assert code == 1 and report["verdict"] == "finding"
    assert verdicts(report)["cold_warm"] == "finding", report["findings"]
    rows = report["sections"][0]["rows"]
    assert all(not r["match"] and "WRONG" in r["warm_answer"] for r in rows)
    assert verdicts(report)["isolation"] == "skipped"  # one key


@pytest.mark.parametrize("fake", ["shared"], indirect=True)
def test_a_cache_shared_across_tenants_is_a_finding(fake, tmp_path, capsys):
    code, report = probe(capsys, fake.url, tmp_path, "--api-key", KEY_A, "--api-key", KEY_B, *QUICK)
    assert code == 1
    assert verdicts(report) == {
        "cold_warm": "ok",
        "prefix_hits": "ok",
        "context": "ok",
        "isolation": "finding",
        "claims": "ok",
    }, report["findings"]
    stats = report["sections"][3]["stats"]
    assert stats["other_vs_cold_b"]["p"] < 0.01 and stats["other_vs_cold_b"]["ratio"] < 0.5


@pytest.mark.parametrize("fake", ["tenant"], indirect=True)
def test_a_correct_per_tenant_cache_is_clean_and_the_probe_imports_no_torch(fake, tmp_path):
    argv = ["probe", fake.url, "--json", "--out", "report", "--api-key", KEY_A, "--api-key", KEY_B, *QUICK]
    code, out, err, heavy = run_cli(argv, tmp_path)
    report = json.loads(out)
    assert code == 0 and report["verdict"] == "clean" and not report["findings"], err
    assert heavy == []  # a pure HTTP client, in a fresh process
    assert set(verdicts(report).values()) == {"ok"}
    assert report["sections"][2]["stats"]["behaviour"] == "refuses"  # the fake's 400 past 2,048 tokens
    claims = report["sections"][4]["stats"]["own_vs_cold_a"]
    assert claims["claimed_share"] > 0.5 and claims["ratio"] < 0.5  # claimed and shown
    assert "probe: timing: trial 6/6" in err  # progress on stderr
    assert (tmp_path / "report" / "report.html").is_file()


@pytest.fixture(scope="module")
def kvlab_serve(tmp_path_factory):
    """``kvlab serve`` on a tiny random model (sinks + a 512-token window, the memory store), two keys."""
    tmp = tmp_path_factory.mktemp("probe-serve")
    server = Server(tmp, "--model", str(build_tiny_model(tmp / "tiny")), "--cache", "sinks=4,window=512")
    yield f"http://127.0.0.1:{server.port}/v1"
    server.stop()


@pytest.mark.parametrize("api", ["chat", "completions"])
def test_kvlab_serve_is_clean(kvlab_serve, api, tmp_path, capsys):
    keys = ("--api-key", KEY_A, "--api-key", KEY_B)
    args = (*keys, "--api", api, "--context", "1024", "--prefix-words", "64", "--max-tokens", "8")
    code, report = probe(capsys, kvlab_serve, tmp_path, *args)  # 8 trials a side (the default)
    assert code == 0, report["findings"]
    context = report["sections"][2]  # its summary and rows say why, when it is not "ok"
    assert verdicts(report) == dict.fromkeys(verdicts(report), "ok"), (verdicts(report), context)
    assert "past the limit" in context["summary"]  # kvlab serve rolls, it does not refuse
    hits = report["sections"][1]["rows"]
    assert all(r["warm_cached"] > 0 and r["cold_cached"] < 16 for r in hits)  # hits and misses, as meant
    assert all(r["cold_logprobs"] for r in report["sections"][0]["rows"])  # log-probabilities compared


BAD = [
    (["ftp://127.0.0.1:1"], "URL"),
    (["not a url"], "URL"),
    (["{url}", "--trials", "4"], "--trials"),
    (["{url}", "--tolerance", "0"], "--tolerance"),
    (["{url}", "--api-key", "a-key-123", "--api-key", "b-key-123", "--api-key", "c-key-123"], "--api-key"),
    (["{url}", "--api", "responses"], "--api"),
]


@pytest.mark.parametrize("argv,names", BAD)
def test_bad_input_exits_2_with_one_line_before_any_request(argv, names, tmp_path):
    fake = FakeServer("tenant")
    try:
        code, out, err, heavy = run_cli(["probe", *(a.format(url=fake.url) for a in argv)], tmp_path)
    finally:
        fake.stop()
    assert code == 2 and out == "" and heavy == [], (code, out, err)
    assert len(err.strip().splitlines()) == 1 and names in err, err
    assert fake.requests == 0
    assert not (tmp_path / "runs").exists()


def test_a_server_that_cannot_be_reached_exits_2(tmp_path):
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code, out, err, heavy = run_cli(["probe", f"http://127.0.0.1:{port}"], tmp_path)
    assert code == 2 and out == "" and "cannot reach" in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "runs").exists()


def test_an_empty_first_turn_is_the_models_and_an_empty_turn_past_the_limit_a_finding():
    from kvlab.probe.checks import _context_verdict

    def row(turn: int, tokens: int, answer: str) -> dict:
        return {"turn": turn, "status": 200, "prompt_tokens": tokens, "answer": answer, "error": ""}

    first = _context_verdict([row(0, 40, "")], limit=1024, estimate=40)
    assert first.verdict == "skipped" and "not tested" in first.summary
    past = _context_verdict([row(0, 40, "a"), row(1, 600, "b"), row(2, 1200, " ")], limit=1024, estimate=1200)
    assert past.verdict == "finding" and "three" not in past.summary and "in a row" in past.summary
