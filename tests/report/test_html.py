"""remnant-report --html: one self-contained page over real runs (a sweep, a frontier search
and a failed run carrying a hostile limit: tests/report/conftest.py), opened in a real
headless Chromium (tests/browser.py)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from remnant.report.runs import find_runs
from tests import browser
from tests.report.conftest import HOSTILE_LIMIT, remnant

needs_chromium = pytest.mark.skipif(
    browser.CHROMIUM is None, reason="chromium is not installed (apt-get install chromium; .ci/run installs it as root)")

# Run in the page once it has loaded: every image decoded (or not), the run directories of
# the runs table, the tables' rows, and whether the hostile limit became markup.
PAGE_FACTS = """(async () => {
  const images = [...document.images];
  await Promise.all(images.map(i => i.decode().catch(() => null)));
  const rows = id => [...document.querySelectorAll(`#${id} tbody tr`)].map(r => [...r.cells].map(c => c.textContent));
  return {
    images: images.map(i => ({alt: i.alt, width: i.naturalWidth, src: i.src.slice(0, 22)})),
    runs: [...document.querySelectorAll('#runs tr.run td:first-child')].map(td => td.textContent),
    summary: rows('summary'), frontier: rows('frontier'), deltas: rows('deltas'),
    failed: document.getElementById('failed').textContent,
    limits: [...document.querySelectorAll('#runs details li, #limits li')].map(li => li.textContent),
    injected: document.getElementById('injected') !== null,
    scripts: document.scripts.length,
  };
})()"""


@pytest.fixture(scope="module")
def page(report_inputs, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("html-report")
    paths = [str(report_inputs.sweep), str(report_inputs.search), str(report_inputs.failed)]
    p = remnant("remnant-report", *paths, "--out", str(out), "--html", cwd=out)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip().splitlines()[-2:] == [str(out / "report.md"), str(out / "report.html")]
    return out / "report.html"


def test_page_holds_everything_in_one_file(page):
    text = page.read_text()
    # Nothing fetched from elsewhere: no script, no URL but data: ones in src or href.
    assert "<script" not in text.lower()
    assert re.findall(r'(?:src|href)="(?!data:)[^"]*"', text) == []
    plots = sorted(p.name for p in page.parent.glob("*.png"))
    assert {"pareto.png", "goodput_vs_load.png", "latency.png"} <= set(plots)
    assert text.count('src="data:image/png;base64,') == len(plots)
    # The hostile limit is text, escaped, wherever it is shown.
    assert HOSTILE_LIMIT not in text and '<b id="injected">' not in text
    assert "&lt;b id=&quot;injected&quot;&gt;x&lt;/b&gt;" in text


@pytest.mark.slow
@needs_chromium
def test_page_in_a_real_browser(page, report_inputs):
    seen = browser.open_page(page.as_uri(), PAGE_FACTS)
    assert seen.errors == []
    assert seen.requests == [page.as_uri()]  # the page itself, nothing else
    facts = seen.value
    assert facts["scripts"] == 0 and not facts["injected"]
    # Every run directory appears, once.
    every = [str(p.parent) for p in find_runs([report_inputs.sweep, report_inputs.search, report_inputs.failed])]
    assert sorted(facts["runs"]) == sorted(every) and len(every) == 7
    # Every inline image decodes, and each plot written is one of them.
    plots = sorted(p.stem for p in page.parent.glob("*.png"))
    assert sorted(i["alt"] for i in facts["images"]) == plots
    assert all(i["width"] > 0 and i["src"] == "data:image/png;base64," for i in facts["images"]), facts["images"]
    # The tables: the sweep's and the search's cells, the search's frontier, the paired
    # deltas with their intervals, the failed run with its stage.
    assert {(r[1], r[3]) for r in facts["summary"]} == {("native", "c=1"), ("native", "c=2"), ("native", "c=4"),
                                                        ("kernel", "c=1"), ("kernel", "c=4")}
    assert len(facts["frontier"]) == 1 and facts["frontier"][0][5] == ">=2.0 concurrency"
    assert sorted(r[4] for r in facts["deltas"]) == ["c=1", "c=4"]
    assert all(int(r[5]) > 0 and "±" in r[6] and "±" in r[7] for r in facts["deltas"])
    assert str(report_inputs.failed) in facts["failed"] and "failed" in facts["failed"] and "serve:" in facts["failed"]
    # The hostile limit reads as the text it is, in the failed run's limits and the report's.
    assert facts["limits"].count(HOSTILE_LIMIT) == 2


@needs_chromium
def test_the_browser_check_sees_a_broken_page(tmp_path):
    # The check above can fail: a console error, an exception, a fetch from elsewhere and an
    # image that does not decode are all reported.
    bad = tmp_path / "bad.html"
    bad.write_text('<!DOCTYPE html><html><head><link rel="stylesheet" href="http://127.0.0.1:1/x.css"></head>'
                   '<body><img alt="b" src="data:image/png;base64,AAAA">'
                   '<script>console.error("boom"); throw new Error("kaboom")</script></body></html>')
    seen = browser.open_page(bad.as_uri(), PAGE_FACTS.replace("document.getElementById('failed').textContent", "''"))
    assert any("boom" in e for e in seen.errors) and any("kaboom" in e for e in seen.errors)
    assert "http://127.0.0.1:1/x.css" in seen.requests
    assert seen.value["images"][0]["width"] == 0
