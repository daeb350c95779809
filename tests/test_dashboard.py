"""Issue 28 item 7: the Grafana dashboard and the Prometheus scrape configuration deploy/ ships
query only metrics the router's /metrics has (router/metrics.py, as it renders them), and parse."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

from pdcluster.router.metrics import RouterMetrics

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
DASHBOARD = DEPLOY / "grafana" / "pdcluster-dashboard.json"


def queries() -> list[str]:
    return [t["expr"] for p in json.loads(DASHBOARD.read_text())["panels"] for t in p["targets"]]


SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}


def exposed() -> set[str]:
    """Every series name the router's /metrics declares (its `# TYPE` lines; a labelled counter
    such as the bytes per KV group has its samples once the first transfer happened)."""
    text = RouterMetrics(lambda: {"prefill-0": 0, "decode-0": 0}, pending_blocks=lambda name: 0).render().decode()
    types = [line.split()[2:4] for line in text.splitlines() if line.startswith("# TYPE ")]
    return {name.removesuffix("_total") + suffix for name, kind in types for suffix in SUFFIXES.get(kind, ("",))}


def test_every_metric_a_panel_queries_is_on_the_routers_metrics():
    have = exposed()
    wanted = {m for q in queries() for m in re.findall(r"\bpdc_\w+", q)}
    assert wanted and wanted <= have, sorted(wanted - have)


def test_the_dashboard_covers_what_users_watch():
    titles = " ".join(p["title"] for p in json.loads(DASHBOARD.read_text())["panels"]).lower()
    for topic in ("ttft", "where ttft goes", "queue", "predicted vs delivered", "bandwidth", "in flight", "429",
                  "migrations"):
        assert topic in titles, topic


def test_the_scrape_configuration_targets_the_routers_metrics():
    conf = yaml.safe_load((DEPLOY / "prometheus" / "pdcluster.yml").read_text())
    job = conf["scrape_configs"][0]
    assert job["metrics_path"] == "/metrics" and job["static_configs"][0]["targets"] == ["127.0.0.1:8000"]
