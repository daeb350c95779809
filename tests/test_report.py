"""The HTML report: self-contained, has its sections, and renders in a real (headless) Chromium."""

from __future__ import annotations

import argparse
import re

import pytest
from chromium import chromium_page
from test_timeline_views import sample_records, write_run

from pdcluster.router.report import render_report, write_report
from pdcluster.router.run_store import load_run
from pdcluster.router.timeline_cli import add_timeline_commands


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
    report = write_report(run, tmp_path / "report.html")
    with chromium_page(report) as (page, errors):
        assert page.title() == "pdcluster run run-test"
        assert page.locator("svg").count() >= 3
        assert page.locator("#gantt-svg g.row").count() == len(sample_records())
        assert page.locator("#attribution-svg g.bar").count() == len(sample_records())
        # laid out, not just parsed: the Gantt has a real size on the page
        box = page.locator("#gantt-svg").bounding_box()
        assert box is not None and box["width"] > 500 and box["height"] > 5 * 16
        shot = tmp_path / "report.png"
        page.screenshot(path=str(shot), full_page=True)
    assert errors == []
    assert shot.exists() and shot.stat().st_size > 20_000
