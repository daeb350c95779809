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
    spec.write_text("model: {path: /nowhere}\nprefill: {instances: 0}\nengine: {block_sise: 64}\n")
    r = pdc("up", str(spec), env_state=tmp_path)
    assert r.returncode == 2
    assert "prefill.instances" in r.stderr and "engine.block_sise" in r.stderr
    assert not list(tmp_path.glob("*.json"))  # no cluster state written


def test_status_and_down_without_a_cluster(tmp_path):
    assert "no cluster started by pdc up" in pdc("status", env_state=tmp_path).stdout
    r = pdc("down", env_state=tmp_path)
    assert r.returncode == 1 and "no cluster started by pdc up" in r.stderr
