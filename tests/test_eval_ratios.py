"""``kvlab eval ruler --ratios``: a policy named without a ratio runs at each; ratios checked before the
model loads (one line, exit 2)."""

from __future__ import annotations

import pytest

from kvlab.errors import BadInputError
from kvlab.eval.specs import bare_score, expand_specs, parse_cache_specs, parse_ratios


def test_ratios_parse():
    assert parse_ratios("0.25,0.5,0.75") == [0.25, 0.5, 0.75]
    assert parse_ratios(" 0 , .5 ") == [0.0, 0.5]
    for bad, why in (
        ("1", r"\[0, 1\)"),
        ("-0.1", r"\[0, 1\)"),
        ("nan", r"\[0, 1\)"),
        ("0.5,abc", "comma-separated"),
        ("", "comma-separated"),
        ("0.5,0.50", "repeat"),
    ):
        with pytest.raises(BadInputError, match=why):
            parse_ratios(bad)


def test_bare_scores_are_found():
    assert bare_score("snapkv") == "snapkv"
    assert bare_score(" H2O ") == "h2o"
    assert bare_score("keynorm") == "keynorm"
    assert bare_score("h2o,sinks=4") == "h2o,sinks=4"
    assert bare_score("window") == "streaming_llm"
    for complete in (
        "full",
        "int4",
        "kivi:int2",
        "codec=kivi2",
        "snapkv:0.5",
        "h2o,keep=0.5",
        "sinks=4,window=64",
    ):
        assert bare_score(complete) is None, complete
    assert bare_score("bogus") is None  # not a score: the reader says what is wrong with it


def test_expansion_over_ratios():
    texts = ["full", "snapkv", "h2o,sinks=4", "int4", "window", "codec=kivi2", "tova:0.5"]
    out = expand_specs(texts, [0.25, 0.5])
    assert out == [
        "full",
        "snapkv:0.25",
        "snapkv:0.5",
        "h2o,sinks=4,ratio=0.25",
        "h2o,sinks=4,ratio=0.5",
        "int4",
        "window:0.25",
        "window:0.5",
        "codec=kivi2",
        "tova:0.5",
    ]
    specs = parse_cache_specs(out)
    assert [(s.kind, s.method, s.ratio) for s in specs[1:5]] == [
        ("evict", "snapkv", 0.25),
        ("evict", "snapkv", 0.5),
        ("evict", "h2o", 0.25),
        ("evict", "h2o", 0.5),
    ]
    assert specs[6].method == "streaming_llm" and specs[6].ratio == 0.25
    assert specs[5].kind == specs[8].kind == "quant"  # codecs are not expanded
    # without ratios, specs pass unchanged, and a bare score is refused naming --ratios
    assert expand_specs(["full", "snapkv:0.5"], None) == ["full", "snapkv:0.5"]
    with pytest.raises(BadInputError, match="give one budget.*--ratios"):
        expand_specs(["snapkv"], None)
    with pytest.raises(BadInputError, match="none was given"):
        expand_specs(["full", "int4", "h2o:0.5"], [0.5])
    with pytest.raises(BadInputError, match="twice"):  # an expanded spec equal to one written out
        parse_cache_specs(expand_specs(["snapkv", "snapkv:0.5"], [0.5]))


def _cli(capsys, *args):
    from kvlab.cli import main

    code = main(["eval", "ruler", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize(
    "args, says",
    [
        (["--cache", "snapkv", "--ratios", "1.0"], "[0, 1)"),
        (["--cache", "snapkv", "--ratios", "0.5,x"], "comma-separated"),
        (["--cache", "snapkv", "--ratios", "0.5,0.5"], "repeat"),
        (["--ratios", "0.5"], "none was given"),
        (["--cache", "int4", "--ratios", "0.5"], "none was given"),
        (["--cache", "snapkv"], "--ratios"),
        (["--cache", "snapkv", "--cache", "snapkv:0.5", "--ratios", "0.5"], "twice"),
        (["--cache", "bogus", "--ratios", "0.5"], "unknown item"),
        (["--ratios", "0.5", "--cache", "h2o", "--lengths", "12"], "outside"),
    ],
)
def test_bad_ratios_are_one_line_and_exit_2_before_loading(args, says, monkeypatch, capsys):
    import kvlab

    monkeypatch.setattr(kvlab, "load_model", lambda *a, **k: pytest.fail("the model loaded"))
    code, out, err = _cli(capsys, *args)
    assert code == 2 and not out, (out, err)
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err and says in err, err


def test_ratios_run_each_policy_at_each_ratio(tiny_llama_2x64, monkeypatch, capsys, tmp_path):
    import json

    import kvlab
    from kvlab.model.handle import ModelHandle
    from tests.test_eval_tasks import HAYSTACK, WordTokenizer

    handle = ModelHandle(tiny_llama_2x64.model, WordTokenizer(), name="tiny-llama")
    monkeypatch.setattr(kvlab, "load_model", lambda *a, **k: handle)
    hay = tmp_path / "hay.txt"
    hay.write_text(HAYSTACK[:20000])
    code, out, err = _cli(
        capsys,
        "--cache", "full", "--cache", "h2o", "--cache", "window", "--cache", "int4", "--ratios", "0.25,0.5",
        "--lengths", "160", "--tasks", "niah_single", "--trials", "1", "-n", "2", "--haystack", str(hay),
        "--out", str(tmp_path / "o"), "--device", "cpu",
    )  # fmt: skip
    assert code == 0, err
    doc = json.loads((tmp_path / "o" / "ruler.json").read_text())
    assert doc["settings"]["ratios"] == [0.25, 0.5]
    assert [c["spec"] for c in doc["settings"]["caches"]] == [
        "full", "h2o:0.25", "h2o:0.5", "window:0.25", "window:0.5", "int4"
    ]  # fmt: skip
    kept = {r["spec"]: r["kept_slots"] / r["context_tokens"] for r in doc["rows"]}
    assert kept["h2o:0.25"] == pytest.approx(0.75, abs=0.02) and kept["h2o:0.5"] == pytest.approx(
        0.5, abs=0.02
    )
    assert "| niah_single | 160 | window:0.5 | 1 |" in out
