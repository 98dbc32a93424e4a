"""The study report renders in a real browser: headless Chromium screenshots index.html and every figure loads.

Skipped where Chromium is not installed (CI installs it: ``apt-get install -y chromium``).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest

CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
)


def _chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome", "/usr/bin/chromium", "/snap/bin/chromium"):
        path = shutil.which(name)
        if path:
            return path
    pytest.skip(
        "headless Chromium is not installed (apt-get install -y chromium, or scripts/install-test-deps.sh)"
    )


class _Images(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.srcs: list[str] = []

    def handle_starttag(self, tag, attrs) -> None:
        if tag == "img":
            self.srcs.append(dict(attrs).get("src", ""))


def _browser(chromium: str, profile_dir: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [chromium, *CHROMIUM_FLAGS, f"--user-data-dir={profile_dir}", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.process
@pytest.mark.slow
def test_study_report_renders_in_chromium(smollm, tmp_path):
    chromium = _chromium()
    from kvlab.study.runner import run_study

    outcome = run_study(only=["inspect"], profile="quick", out=tmp_path / "runs", show_progress=False)
    index = outcome.run_dir / "index.html"
    assert index.is_file() and not outcome.failed
    expected = {f"inspect/{f.filename}" for _, r in outcome.results for f in r.figures}
    assert expected, "the inspect experiment should produce figures"

    # 1. The DOM Chromium builds holds every figure, and every image file exists and decodes.
    dom = _browser(chromium, tmp_path / "profile-dom", "--dump-dom", index.as_uri())
    assert dom.returncode == 0, dom.stderr[-2000:]
    parser = _Images()
    parser.feed(dom.stdout)
    assert expected <= set(parser.srcs), (
        f"missing figures in the rendered page: {expected - set(parser.srcs)}"
    )
    import matplotlib.image as mpimg

    for src in parser.srcs:
        path = (index.parent / src).resolve()
        assert path.is_file(), f"<img src={src!r}> points at no file"
        img = mpimg.imread(path)
        assert img.ndim == 3 and min(img.shape[:2]) > 50, f"{src} is not a real figure: shape {img.shape}"
    for _, r in outcome.results:  # the one-line captions are on the page too
        for f in r.figures:
            assert re.sub(r"\s+", " ", f.caption)[:40] in re.sub(
                r"\s+", " ", dom.stdout.replace("&amp;", "&")
            )

    # 2. Each section opens with its finding and headline numbers; the glossary is on top; the full
    # summary is collapsed; the raw results are linked and exist.
    text = re.sub(r"\s+", " ", dom.stdout.replace("&amp;", "&"))
    assert 'id="glossary"' in dom.stdout and "the thread" in text and "Phase 1" in text
    for sub, r in outcome.results:
        assert r.finding and re.sub(r"\s+", " ", r.finding)[:60] in text
        assert r.headline and all(str(label) in text for label, _ in r.headline)
        assert "<details>" in dom.stdout and "All numbers" in text
        for link in ("result.json", "arrays.npz") if r.arrays else ("result.json",):
            assert f'href="{sub}/{link}"' in dom.stdout and (index.parent / sub / link).is_file()

    # 3. A screenshot of the page is not blank.
    shot = tmp_path / "report.png"
    run = _browser(
        chromium, tmp_path / "profile-shot", f"--screenshot={shot}", "--window-size=1280,2000", index.as_uri()
    )
    assert run.returncode == 0 and shot.is_file(), run.stderr[-2000:]
    pixels = mpimg.imread(shot)[..., :3]
    assert pixels.shape[0] >= 1000 and pixels.shape[1] >= 1000
    not_white = (pixels < 0.95).any(axis=-1).mean()
    assert not_white > 0.02, f"the screenshot is almost blank ({not_white:.1%} non-white pixels)"
    assert np.unique(pixels.reshape(-1, 3).round(2), axis=0).shape[0] > 50  # text, plots, colours
