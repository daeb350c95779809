"""cluster/vllm_sources.py unpacks only each version's .py files and metadata, and a cache
entry counts only once complete (no network: a wheel and an sdist made here)."""

from __future__ import annotations

import io
import tarfile
import zipfile

import pytest

from pdcluster.cluster import vllm_sources
from pdcluster.cluster.vllm_sources import SOURCES, SourceDist, source_path


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PDC_VLLM_SOURCES", str(tmp_path))
    return tmp_path


def wheel_bytes() -> io.BytesIO:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as whl:
        whl.writestr("vllm/__init__.py", "")
        whl.writestr("vllm/v1/outputs.py", "class KVConnectorOutput: ...\n")
        whl.writestr("vllm/_C.abi3.so", b"\0" * 10)
        whl.writestr("vllm-0.33.0.dist-info/METADATA", "Requires-Dist: torch==2.10.0\n")
    buf.seek(0)
    return buf


def sdist_bytes() -> io.BytesIO:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as sdist:
        for name, text in (("vllm_ascend-0.23.0.post1/vllm_ascend/worker/model_runner_v1.py", "x = 1\n"),
                           ("vllm_ascend-0.23.0.post1/requirements.txt", "torch==2.10.0\n"),
                           ("vllm_ascend-0.23.0.post1/csrc/kernel.cpp", "int main;\n")):
            info = tarfile.TarInfo(name)
            info.size = len(text)
            sdist.addfile(info, io.BytesIO(text.encode()))
    buf.seek(0)
    return buf


def test_a_wheel_keeps_its_python_and_metadata_only(tmp_path):
    kept = vllm_sources._unpack_wheel(wheel_bytes(), SOURCES["vllm-0.33.0"], tmp_path)
    assert kept == 3
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file()) == [
        "METADATA", "vllm/__init__.py", "vllm/v1/outputs.py"]


def test_an_sdist_keeps_its_package_and_requirements(tmp_path):
    dist = SOURCES["vllm-ascend-0.23.0.post1"]
    assert dist.sdist and dist.package == "vllm_ascend"
    vllm_sources._unpack_sdist(sdist_bytes(), dist, tmp_path)
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file()) == [
        "requirements.txt", "vllm_ascend/worker/model_runner_v1.py"]


def test_an_entry_without_its_complete_marker_is_not_fetched(cache):
    (cache / "vllm-0.33.0" / "vllm").mkdir(parents=True)  # a download that died
    assert source_path("vllm-0.33.0") is None
    (cache / "vllm-0.33.0" / vllm_sources.COMPLETE).write_text("{}")
    assert source_path("vllm-0.33.0") == cache / "vllm-0.33.0"


def test_the_file_chosen_is_the_x86_wheel_or_the_sdist():
    wheel = SourceDist("vllm-0.33.0", "vllm", "0.33.0", "vllm")
    assert wheel.filename_ok("vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl")
    assert not wheel.filename_ok("vllm-0.33.0-cp38-abi3-manylinux_2_28_aarch64.whl")
    assert not wheel.filename_ok("vllm-0.33.0.tar.gz")
    assert SOURCES["vllm-ascend-0.23.0.post1"].filename_ok("vllm_ascend-0.23.0.post1.tar.gz")
