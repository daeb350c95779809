"""`pdc up` / `pdc status` / `pdc down` as a user runs them: separate processes, a detached cluster."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import yaml
from e2e import cluster_spec_for, wait_until
from test_cli import pdc

from pdcluster.router.run_store import load_run

pytestmark = pytest.mark.e2e


def test_up_status_serve_down(tmp_path):
    spec = cluster_spec_for("e2e-cli")
    spec_file = tmp_path / "cluster.yaml"
    spec_file.write_text(yaml.safe_dump(spec.model_dump(mode="json", exclude_none=True)))
    url = f"http://{spec.router.bind_host('127.0.0.1')}:{spec.router.port}"
    up = pdc("up", str(spec_file), env_state=tmp_path, timeout=600)
    try:
        assert up.returncode == 0, up.stderr[-3000:]
        assert f"endpoint: {url}/v1" in up.stdout and "P1 D1" in up.stdout

        status = pdc("status", env_state=tmp_path)
        assert status.returncode == 0, status.stderr[-3000:]
        lines = status.stdout.splitlines()
        assert any("prefill-0" in l and "healthy" in l for l in lines), status.stdout
        # each instance's planes, as it advertises them (loopback: one node)
        at = lines.index(next(l for l in lines if "prefill-0" in l and "healthy" in l)) + 1
        assert "requests 127.0.0.1:" in lines[at] and "kv 127.0.0.1:" in lines[at] and \
            "kv events 127.0.0.1:" in lines[at], status.stdout
        assert any("decode-0" in l and "healthy" in l for l in lines), status.stdout

        r = httpx.post(f"{url}/v1/completions", timeout=60,
                       json={"prompt": "hello there", "max_tokens": 4, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        # A second cluster that cannot start, on the same Ray: each failing instance named, and
        # the running cluster untouched.
        up_failing_instances(tmp_path / "bad")
        assert pdc("status", env_state=tmp_path).stdout == status.stdout
        # One still streaming at `pdc down`: the router's stop ends it and records that.
        pool = ThreadPoolExecutor(1)
        streaming = pool.submit(_stream_until_cut, url)
        wait_until(lambda: _tokens_streamed > 0, 60, what="the long request streaming")
    finally:
        down = pdc("down", env_state=tmp_path, timeout=120)
    assert down.returncode == 0, down.stderr[-3000:]
    assert streaming.result(timeout=30) < 1000, "the stream outlived pdc down"
    run_dir = next(line.split()[1] for line in up.stdout.splitlines() if line.startswith("timelines: "))
    run = load_run(run_dir)  # no warning: nothing is unfinished
    assert run.unfinished == [] and len(run.records) == 2
    assert run.record("cmpl-long").error == "cancelled: the router stopped", run.record("cmpl-long")
    assert "stopped e2e-cli:prefill-0" in down.stdout and "stopped e2e-cli:router" in down.stdout
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{url}/health", timeout=5)
    assert "no cluster started by pdc up" in pdc("status", env_state=tmp_path).stdout


_tokens_streamed = 0


def _stream_until_cut(url: str) -> int:
    """A long streamed completion; the tokens it got before its stream ended or broke."""
    global _tokens_streamed
    try:
        with httpx.stream("POST", f"{url}/v1/completions", timeout=120, headers={"X-Request-Id": "long"},
                          json={"prompt": "a long one", "max_tokens": 1000, "temperature": 0,
                                "ignore_eos": True, "stream": True}) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    _tokens_streamed += 1
    except httpx.HTTPError:
        pass
    return _tokens_streamed


def up_failing_instances(state_dir):
    """`pdc up` of a spec whose P and D both fail to start: it exits 1 naming each with its own
    error and writes no state. P: an engine argument vLLM does not know (the actor fails building
    its args). D: too few KV blocks for max_model_len (vLLM's engine core process raises while
    starting, and the error it prints to the worker's log is what `pdc up` shows)."""
    spec = cluster_spec_for("e2e-cli-bad")
    spec = spec.model_copy(update={
        "prefill": spec.prefill.model_copy(update={"engine": spec.prefill.engine.model_copy(
            update={"extra": {"bogus_engine_arg": 1}})}),
        "decode": spec.decode.model_copy(update={"engine": spec.decode.engine.model_copy(
            update={"extra": {"num_gpu_blocks_override": 4}})})})
    state_dir.mkdir()
    spec_file = state_dir / "cluster.yaml"
    spec_file.write_text(yaml.safe_dump(spec.model_dump(mode="json", exclude_none=True)))
    up = pdc("up", str(spec_file), env_state=state_dir, timeout=300)
    assert up.returncode == 1, up.stderr[-2000:]
    assert not list(state_dir.glob("*.json"))
    lines = [line for line in up.stderr.splitlines() if "failed to start" in line]
    p_line = next((line for line in lines if "instance prefill-0 failed to start" in line), None)
    d_line = next((line for line in lines if "instance decode-0 failed to start" in line), None)
    assert p_line is not None and "bogus_engine_arg" in p_line, up.stderr[-2000:]
    assert d_line is not None and "engine core failed to start: ValueError: To serve at least one request" in d_line, \
        up.stderr[-2000:]
