"""`pdc` commands that need no engine: model generation, spec errors before anything starts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

PDC = [sys.executable, "-m", "pdcluster.cluster.cli"]


def pdc(*args: str, env_state: Path | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    import os

    env = dict(os.environ)
    if env_state is not None:
        env["PDC_STATE_DIR"] = str(env_state)
    return subprocess.run([*PDC, *args], capture_output=True, text=True, timeout=timeout, env=env)


def test_model_tiny_writes_a_loadable_checkpoint(tmp_path):
    out = tmp_path / "m"
    r = pdc("model", "tiny", str(out), "--arch", "llama", "--seed", "7")
    assert r.returncode == 0, r.stderr
    assert "wrote tiny llama model (seed 7)" in r.stdout
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "llama" and (out / "tokenizer.json").exists()


def test_up_with_invalid_spec_fails_before_starting_anything(tmp_path):
    spec = tmp_path / "bad.yaml"
    spec.write_text("model: {path: /nowhere}\nprefill: {instances: -1}\nengine: {block_sise: 64}\n")
    r = pdc("up", str(spec), env_state=tmp_path)
    assert r.returncode == 2
    assert "prefill.instances" in r.stderr and "engine.block_sise" in r.stderr
    assert not list(tmp_path.glob("*.json"))  # no cluster state written


def test_status_and_down_without_a_cluster(tmp_path):
    assert "no cluster started by pdc up" in pdc("status", env_state=tmp_path).stdout
    r = pdc("down", env_state=tmp_path)
    assert r.returncode == 1 and "no cluster started by pdc up" in r.stderr


def test_down_leaves_clusters_another_checkout_started(tmp_path):
    """Issue 28 item 5: a cluster recorded by another checkout (or an older pdc, which recorded
    none) is not this one's to stop without --name or --all."""
    for name, checkout in (("theirs", "/elsewhere/pdcluster"), ("old", None)):
        state = {"name": name, "spec": "/x.yaml", "url": "http://127.0.0.1:1", "started_ray": False,
                 "ray_address": None, "run_dir": None, **({"checkout": checkout} if checkout else {})}
        (tmp_path / f"{name}.json").write_text(json.dumps(state))
    r = pdc("down", env_state=tmp_path)
    assert r.returncode == 1 and "no cluster started by pdc up from this checkout (2 from elsewhere" in r.stderr
    assert len(list(tmp_path.glob("*.json"))) == 2  # nothing touched
    r = pdc("down", "--name", "theirs", "--all", env_state=tmp_path)
    assert r.returncode == 2 and "--name and --all" in r.stderr


def test_up_with_an_unsupported_vllm_fails_before_any_engine_starts(monkeypatch):
    from e2e import cluster_spec_for

    from pdcluster.cluster import launch
    from pdcluster.transfer import vllm_compat

    def started(*a, **kw):
        raise AssertionError("an engine was started")

    monkeypatch.setattr(vllm_compat, "installed_version", lambda: "0.31.0")
    monkeypatch.setattr(launch, "alive_nodes", lambda: [])
    monkeypatch.setattr(launch, "settle_spec", lambda spec, nodes: spec)
    monkeypatch.setattr(launch, "ensure_model", started)
    monkeypatch.setattr(launch, "engine_class", started)
    try:
        launch.build_cluster(cluster_spec_for("unsupported"))
    except launch.ClusterStartError as err:
        assert "vLLM 0.31.0 is installed; pdcluster supports vLLM 0.23.0, 0.26.0, 0.32.0, 0.33.0, 0.34.0" in str(err)
    else:
        raise AssertionError("build_cluster started a cluster on vLLM 0.31.0")


def test_model_tiny_refuses_a_folder_that_holds_files_without_force(tmp_path):
    """Issue 28 item 5: it used to delete a checkpoint's weight shards without a word."""
    out = tmp_path / "m"
    out.mkdir()
    (out / "model-00001-of-00002.safetensors").write_text("a real shard")
    r = pdc("model", "tiny", str(out))
    assert r.returncode == 2 and "is not an empty folder" in r.stderr and "--force" in r.stderr
    assert (out / "model-00001-of-00002.safetensors").read_text() == "a real shard"


def test_version():
    r = pdc("--version")
    assert r.returncode == 0 and r.stdout.startswith("pdc ")


def test_fit_and_plan_make_the_folder_they_are_told_to_write_in(tmp_path):
    from pdcluster.cluster.cli import main

    out = tmp_path / "new" / "deeper"
    main(["plan", "dsv4-flash-910c", "--devices", "3", "--input-len", "4100", "--num-requests", "6", "--splits", "1",
          "--slo-ttft-ms", "1000", "--headroom", "none", "--no-twin", "--out", str(tmp_path / "plan"),
          "--write-spec", str(out / "chosen.yaml")])
    assert (out / "chosen.yaml").read_text().startswith("# Written by pdc plan")


def test_a_ray_address_that_refuses_us_is_a_message_not_a_traceback(tmp_path, monkeypatch, capsys):
    """Issue 28 item 5: joining a Ray that wants its token without it (as a lab's printed address
    did) ends in one line saying how, not ray.init's ConnectionError traceback."""
    import pytest
    import ray
    import yaml

    from pdcluster.cluster import cli

    def refused(**kw):
        raise ConnectionError("InvalidAuthToken: the token is missing or wrong\nmore lines")

    monkeypatch.setattr(ray, "init", refused)
    monkeypatch.setattr(cli, "STATE_DIR", tmp_path / "state")
    spec = tmp_path / "s.yaml"
    spec.write_text(yaml.safe_dump({"model": {"path": str(tmp_path)}, "ray_address": "10.213.0.1:6379"}))
    with pytest.raises(SystemExit) as err:
        cli.main(["up", str(spec)])
    msg = capsys.readouterr().err
    assert err.value.code == 1 and "cannot join the Ray cluster at ray_address 10.213.0.1:6379: InvalidAuthToken" in msg
    assert "~/.ray/auth_token" in msg and "ray_address: auto" in msg and "more lines" not in msg
