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
    assert "P cached 120 (64 from its host tier), D cached 30" in html


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


def test_full_ids_the_phases_each_instance_and_the_provenance(tmp_path):
    """Issue 28 item 4, on a replayed run: request ids whole, each phase where it begins, the
    formal window by default, a chart per instance, bytes in human units, what the run ran."""
    from test_timeline_window import replay_run

    from pdcluster.router.timeline_window import select

    run = replay_run(tmp_path)  # seed, check, four formal requests and one user request, ids ~30 characters
    html = render_report(run)
    for r in run.records:
        assert f">{r.request_id}</text>" in html  # whole, not cut to 18 characters
    assert [m for m in re.findall(r'data-phase="(\w*)"', html)][:3] == ["seed", "check", "formal"]
    assert html.count(" phase</text>") == 3  # a mark where the seed, check and formal phases begin
    assert html.count('<svg class="instance"') == 0  # no P or D events in this run: nothing per instance
    formal, line = select(run)
    page = render_report(formal, line)
    assert page.count('class="row"') == 4 and "window: the formal phase (4 of 7 requests" in page
    assert 'id="provenance">spec <b>' in page


def test_each_instance_is_drawn_over_time(run):
    html = render_report(run)
    assert html.count('<svg class="instance"') == 3  # P0, P1, D0
    assert "P0 (prefill)" in html and "D0 (decode)" in html and "KV tokens held: max " in html
    assert "group 0 (swa_kv): 6.0 kB" in html  # human units, under the group's name
