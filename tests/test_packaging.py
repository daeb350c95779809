"""The installed package is the whole tree: every module and data file of the users' folders is
in the wheel (setup.py finds them), and `pdc` works from a wheel installed in a fresh venv, not
only from the editable checkout."""

from __future__ import annotations

import shutil
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest
from test_layers import LAYERS as FOLDERS

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """Built from a copy of the tree: setuptools' build/ folder in the checkout keeps what an earlier
    build copied there, and would hide a module the package list no longer finds."""
    out = tmp_path_factory.mktemp("wheel")
    src = out / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".git", ".venv", "build", "*.egg-info", "__pycache__",
                                                             ".pdcluster"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(out)], check=True, capture_output=True)
    (path,) = out.glob("pdcluster-*.whl")
    return path


def _tree_files() -> set[str]:
    return {f"pdcluster/{f.relative_to(ROOT)}" for folder in FOLDERS for f in (ROOT / folder).rglob("*")
            if f.is_file() and "__pycache__" not in f.parts and f.suffix != ".pyc"}


def test_the_wheel_holds_every_module_and_data_file(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    tree = _tree_files()
    assert {"pdcluster/cluster/sim/virtual/run.py", "pdcluster/cluster/sim/params/dsv4-flash-910c.yaml",
            "pdcluster/cluster/vllm_site/sitecustomize.py"} <= tree  # the test reads the tree it means to
    missing = sorted(tree - names)
    assert not missing, f"in the source tree, not in the wheel: {missing}"
    entry_points = zipfile.ZipFile(wheel).read(
        next(n for n in names if n.endswith(".dist-info/entry_points.txt"))).decode()
    assert "pdc = pdcluster.cluster.cli:main" in entry_points


@pytest.mark.e2e
def test_pdc_sim_runs_from_the_wheel_in_a_fresh_venv(wheel, tmp_path):
    """The wheel in a venv of its own; its dependencies come from this one's site-packages (added
    as a plain path, so the editable install's finder is not among them)."""
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=False)
    py = env_dir / "bin" / "python"
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          check=True, capture_output=True, text=True).stdout.strip()
    ours = subprocess.run([sys.executable, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          check=True, capture_output=True, text=True).stdout.strip()
    (Path(site) / "deps.pth").write_text(ours + "\n")
    subprocess.run([str(py), "-m", "pip", "install", "--no-deps", "-q", str(wheel)], check=True, capture_output=True)
    where = subprocess.run([str(py), "-c", "import pdcluster.cluster.sim.virtual.run as m; print(m.__file__)"],
                           check=True, capture_output=True, text=True, cwd=tmp_path).stdout
    assert where.startswith(site), f"imported from {where}, not the wheel's install"
    out = subprocess.run([str(env_dir / "bin" / "pdc"), "sim", "run", str(ROOT / "deploy/p8d8-sim.yaml"),
                          "--preset", "c90-tiny", "--out", str(tmp_path / "run")],
                         capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    assert (tmp_path / "run" / "timeline" / "requests.jsonl").stat().st_size > 0
