"""Every panel of deploy/grafana/pdcluster-dashboard.json, evaluated by a real Prometheus scraping a
running router with deploy/prometheus/pdcluster.yml (issue 28 item 7): which queries return data.

    .venv/bin/pdc up deploy/p1d1-tiny-cpu.yaml && .venv/bin/pdc bench run --preset c90-tiny
    .venv/bin/python -m pdcluster.bench.dashboard_check --router 127.0.0.1:8000 [--load]

Starts `prometheus` (Debian's package) on a free port with the shipped scrape configuration, its
target replaced by --router and its interval shortened to 1 s, in a temporary directory; with
--load, sends a c90-tiny replay through the router while it scrapes; then runs each panel's query
(`$__rate_interval` as 30s) through Prometheus's HTTP API and prints, per panel, the series it
returned. Stops Prometheus and removes its directory. Exit code 1 if a panel returned nothing.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import yaml

from pdcluster.bench.wrk_load import free_port, wait_http

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--router", default="127.0.0.1:8000", help="host:port of the router's HTTP endpoint")
    ap.add_argument("--load", action="store_true", help="replay c90-tiny through the router while scraping")
    ap.add_argument("--scrape-s", type=float, default=20.0, help="how long to scrape before querying")
    a = ap.parse_args(argv)
    if shutil.which("prometheus") is None:
        print("dashboard_check: no prometheus on PATH (apt-get install prometheus)", file=sys.stderr)
        return 2
    conf = yaml.safe_load((DEPLOY / "prometheus" / "pdcluster.yml").read_text())
    conf["global"]["scrape_interval"] = conf["global"]["evaluation_interval"] = "1s"
    conf["scrape_configs"][0]["static_configs"] = [{"targets": [a.router]}]
    panels = json.loads((DEPLOY / "grafana" / "pdcluster-dashboard.json").read_text())["panels"]
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="pdc-prom-") as tmp:
        (Path(tmp) / "prometheus.yml").write_text(yaml.safe_dump(conf))
        prom = subprocess.Popen(["prometheus", f"--config.file={tmp}/prometheus.yml", f"--storage.tsdb.path={tmp}/data",
                                 f"--web.listen-address=127.0.0.1:{port}"], stdout=subprocess.DEVNULL,
                                stderr=open(Path(tmp) / "prometheus.log", "w"))
        try:
            base = f"http://127.0.0.1:{port}"
            wait_http(f"{base}/-/ready", 30, prom)  # 503 until its storage is up
            if a.load:
                subprocess.run([sys.executable, "-m", "pdcluster.cluster.cli", "bench", "run", "--base-url",
                                f"http://{a.router}", "--preset", "c90-tiny", "--no-progress",
                                "--out", f"{tmp}/bench"], check=True, capture_output=True)
            time.sleep(a.scrape_s)
            empty = 0
            for p in panels:
                for t in p["targets"]:
                    q = t["expr"].replace("$__rate_interval", "30s")
                    r = httpx.get(f"{base}/api/v1/query", params={"query": q}, timeout=10).json()
                    series = r.get("data", {}).get("result", []) if r.get("status") == "success" else []
                    values = [s["value"][1] for s in series]
                    empty += not series
                    print(f"{'ok  ' if series else 'NONE'} {p['title']} [{t['legendFormat']}]: {len(series)} series "
                          f"{', '.join(values[:4])}" + ("" if r.get("status") == "success" else f" ({r.get('error')})"))
            return 1 if empty else 0
        finally:
            prom.terminate()
            prom.wait(timeout=30)


if __name__ == "__main__":
    raise SystemExit(main())
