"""`pdc check SPEC` (cluster/check.py): what `pdc up` would trip on, found without starting anything."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import yaml

from pdcluster.cluster.check import check
from pdcluster.cluster.cli import main
from pdcluster.proto.spec import load_spec

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"


def spec_file(tmp_path: Path, **changes) -> Path:
    """deploy/p1d1-tiny-cpu.yaml with a checkpoint of its own in tmp_path, and `changes` over it."""
    data = yaml.safe_load((DEPLOY / "p1d1-tiny-cpu.yaml").read_text())
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text('{"model_type": "qwen3"}')
    data["model"] = {"path": str(model), "name": "tiny"}
    data.update(changes)
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def levels(path: Path) -> dict[str, str]:
    return {f.what.split(":")[0]: f.level for f in check(load_spec(path))}


def test_a_spec_pdc_up_would_start_passes(tmp_path, capsys):
    from e2e import free_port

    path = spec_file(tmp_path, router={"port": free_port()})
    main(["check", str(path)])
    out = capsys.readouterr().out
    assert out.startswith(f"{path}: the spec is valid (cpu, P1 D1, vllm engines)")
    assert "FAIL" not in out and "ok    model qwen3: in the installed vLLM" in out


def test_deepseek_v4_on_the_npu_set_is_refused_naming_the_versions_that_have_it(capsys):
    with pytest.raises(SystemExit) as err:
        main(["check", str(DEPLOY / "p8d8-npu.yaml")])
    out = capsys.readouterr()
    assert err.value.code == 2 and "would not start" in out.err
    assert ("FAIL  model deepseek_v4: vLLM 0.23.0 + vLLM-Ascend 0.23.0.post1 (the NPU set deploy/setup.sh installs) "
            "does not have it; vLLM 0.32.0, 0.33.0, 0.34.0 do and no released vLLM-Ascend") in out.out
    assert "warn  model.path /models/DeepSeek-V4-Flash: no config.json on this host" in out.out


def test_a_missing_checkpoint_a_core_that_is_not_there_and_a_busy_port_fail(tmp_path):
    path = spec_file(tmp_path, prefill={"instances": 1, "resources": {"cpu_bind": ["4096"]}})
    assert levels(path)["cpu_bind names cores [4096]"] == "FAIL"
    data = yaml.safe_load(path.read_text())
    data["model"] = {"path": str(tmp_path / "nothing")}
    path.write_text(yaml.safe_dump(data))
    assert levels(path)[f"model.path {tmp_path / 'nothing'}"] == "FAIL"
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        path = spec_file(tmp_path, router={"port": busy.getsockname()[1]})
        found = [f for f in check(load_spec(path)) if f.level == "FAIL"]
        assert len(found) == 1 and f"127.0.0.1:{busy.getsockname()[1]} (router.port" in found[0].what


def test_the_specs_own_errors_exit_2_naming_the_field(tmp_path, capsys):
    path = spec_file(tmp_path, engine={"block_sise": 64})
    with pytest.raises(SystemExit) as err:
        main(["check", str(path)])
    assert err.value.code == 2 and "engine.block_sise" in capsys.readouterr().err


def test_a_simulated_cluster_needs_no_vllm_and_no_device():
    assert [f.level for f in check(load_spec(DEPLOY / "p8d8-sim.yaml"))].count("FAIL") == 0


def test_a_router_on_another_host_told_to_listen_on_loopback_is_named(tmp_path):
    path = spec_file(tmp_path, router={"labels": {"pdc-host": "host2"}, "host": "127.0.0.1"})
    (finding,) = [f for f in check(load_spec(path)) if f.what.startswith("router.labels")]
    assert finding.level == "warn" and "router.host 127.0.0.1 answers only on that host" in finding.what
    for router in ({"labels": {"pdc-host": "host2"}},  # unset: it listens on its host's address
                   {"labels": {"pdc-host": "host2"}, "host": "0.0.0.0"}):
        path = spec_file(tmp_path, router=router)
        assert not [f for f in check(load_spec(path)) if f.what.startswith("router.labels")]
