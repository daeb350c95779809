"""The HTML report: self-contained, has its sections, and renders in a real (headless) Chromium."""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path

import pytest
from test_timeline_views import sample_records, write_run

from pdcluster.router.report import render_report, write_report
from pdcluster.router.timeline import load_run
from pdcluster.router.timeline_cli import add_timeline_commands

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


@pytest.fixture
def run(tmp_path):
    return load_run(write_run(tmp_path / "run"))


def test_html_is_self_contained_and_has_the_sections(run):
    html = render_report(run)
    assert not re.search(r"https?://", html)  # no CDN, no fonts, no namespaces pointing anywhere
    assert not re.search(r"<(script|link)[^>]+src=", html)
    for section in ('id="summary"', 'id="gantt"', 'id="attribution"', 'id="cdf"', 'id="critical-path"',
                    'id="failures"'):
        assert section in html
    assert html.count('class="row"') == len(run.records) == html.count('class="bar"')
    assert html.count('<svg class="cdf"') == 6  # five critical-path parts + TTFT
    assert "ms since the first arrival" in html and "TTFT 40.00 ms" in html and "failed after dispatch" in html


def test_cli_report_default_path(tmp_path, capsys):
    path = write_run(tmp_path / "run")
    ap = argparse.ArgumentParser(prog="pdc")
    add_timeline_commands(ap.add_subparsers(dest="cmd", required=True))
    a = ap.parse_args(["timeline", "report", str(path)])
    a.fn(a)
    assert capsys.readouterr().out.strip() == str(path / "report.html")
    assert (path / "report.html").read_text().startswith("<!DOCTYPE html>")


def test_report_renders_in_chromium(run, tmp_path):
    if not CHROMIUM.exists():
        if os.environ.get("PDC_REQUIRE_CHROMIUM") == "1":
            pytest.fail(f"{CHROMIUM} is missing and PDC_REQUIRE_CHROMIUM=1")
        pytest.skip(f"{CHROMIUM} is not installed (apt-get install chromium); set PDC_REQUIRE_CHROMIUM=1 to fail")
    if os.environ.get("PDC_REQUIRE_CHROMIUM") == "1":
        from playwright import sync_api
    else:
        sync_api = pytest.importorskip("playwright.sync_api")
    report = write_report(run, tmp_path / "report.html")
    errors: list[str] = []
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.on("console", lambda m: errors.append(f"console: {m.text}") if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(f"pageerror: {e}"))
            page.on("requestfailed", lambda r: errors.append(f"request failed: {r.url}"))
            page.goto(report.as_uri(), wait_until="load")
            assert page.title() == "pdcluster run run-test"
            assert page.locator("svg").count() >= 3
            assert page.locator("#gantt-svg g.row").count() == len(sample_records())
            assert page.locator("#attribution-svg g.bar").count() == len(sample_records())
            # laid out, not just parsed: the Gantt has a real size on the page
            box = page.locator("#gantt-svg").bounding_box()
            assert box is not None and box["width"] > 500 and box["height"] > 5 * 16
            shot = tmp_path / "report.png"
            page.screenshot(path=str(shot), full_page=True)
        finally:
            browser.close()
    assert errors == []
    assert shot.exists() and shot.stat().st_size > 20_000
