"""report.html as a reader sees it: rendered in headless Chromium, its plots decoded and in view.

Needs a Chromium binary (Debian's `chromium` package; `.ci/run` installs it) and the
Python `playwright` package, which drives that binary and downloads no browser of its
own. Where no Chromium is found the test is skipped with the reason, except when
OPSWAP_REQUIRE_BROWSER=1 (set by `.ci/run`), where that is a failure: CI must run it.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from opswap.report import write_reports

# What the machine's closed network needs: no background connections, no sandbox as root.
_FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def _chromium() -> str:
    for name in (
        os.environ.get("OPSWAP_CHROMIUM", ""),
        "chromium",
        "chromium-browser",
        "google-chrome",
        "google-chrome-stable",
    ):
        path = name and shutil.which(name)
        if path:
            return path
    if os.environ.get("OPSWAP_REQUIRE_BROWSER") == "1":
        pytest.fail(
            "no Chromium binary found and OPSWAP_REQUIRE_BROWSER=1: install Debian's "
            "chromium package or set OPSWAP_CHROMIUM to the browser's path"
        )
    pytest.skip(
        "no Chromium binary on this machine (apt-get install chromium, or set OPSWAP_CHROMIUM)"
    )


pytestmark = pytest.mark.xdist_group("bert_report")  # bert_result is made once (conftest)


@pytest.fixture(scope="module")
def report_dir(tmp_path_factory, bert_result) -> Path:
    out = tmp_path_factory.mktemp("report")
    write_reports(bert_result, out)
    return out


# One pass over the page in the browser: what a reader would see is broken or missing.
_INSPECT = """() => {
  const imgs = Array.from(document.images).map(i => ({
    alt: i.alt, complete: i.complete, natural: i.naturalWidth, natural_h: i.naturalHeight,
    shown: i.getBoundingClientRect().width, right: i.getBoundingClientRect().right}));
  const body = document.body.getBoundingClientRect();
  const boxed = e => e.closest('.tablebox') || e;
  const wide = Array.from(document.querySelectorAll('table, pre, figure, p, ul, h1, h2, h3'))
    .filter(e => boxed(e).getBoundingClientRect().right > window.innerWidth + 1)
    .map(e => e.tagName + ': ' + e.textContent.slice(0, 60));
  const scrolled = Array.from(document.querySelectorAll('.tablebox'))
    .filter(b => b.scrollWidth > b.clientWidth + 1)
    .map(b => b.textContent.slice(0, 60));
  return {title: document.title, scrolled, h1: Array.from(document.querySelectorAll('h1')).map(e => e.textContent),
          h2: Array.from(document.querySelectorAll('h2')).map(e => e.textContent),
          imgs, wide, scroll_w: document.documentElement.scrollWidth, inner_w: window.innerWidth,
          body_right: body.right, tables: document.querySelectorAll('table').length};
}"""


@pytest.mark.parametrize("width", [1280, 800])
def test_report_renders_in_chromium(report_dir, width, tmp_path):
    exe = _chromium()
    sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright")
    errors: list[str] = []
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=exe, args=_FLAGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": width, "height": 900})
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.goto((report_dir / "report.html").as_uri(), wait_until="load")
            seen = page.evaluate(_INSPECT)
            page.screenshot(path=str(tmp_path / f"report_{width}.png"), full_page=True)
        finally:
            browser.close()
    assert not errors, errors
    assert "zoo:bert" in seen["title"] and seen["h1"], seen["title"]
    for h in ("Variants, timed in one run", "Verification", "Where the time goes (cost model)"):
        assert h in seen["h2"], (h, seen["h2"])
    assert seen["tables"] >= 3
    # Every plot decoded (a broken data: URI gives naturalWidth 0) and laid out inside the page.
    alts = [i["alt"] for i in seen["imgs"]]
    assert len(seen["imgs"]) >= 4, alts
    for img in seen["imgs"]:
        assert img["complete"] and img["natural"] > 100 and img["natural_h"] > 50, img
        assert 0 < img["shown"] <= width and img["right"] <= width + 1, img
    # Nothing runs off the right edge: wide tables scroll inside their own box, and at a
    # desktop width none needs to (the "What changed" table once ran 1608 px wide at 1280).
    assert not seen["wide"], seen["wide"]
    if width >= 1280:
        assert not seen["scrolled"], seen["scrolled"]
    assert seen["scroll_w"] <= seen["inner_w"] + 1, (seen["scroll_w"], seen["inner_w"])
