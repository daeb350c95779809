"""The package list, found rather than listed (pyproject.toml holds everything else).

The users' top-level folders install as `pdcluster.<folder>`; every package under them is
found, and every other file in them (corpus text, parameter files, vLLM's site hook) is
package data. tests/test_packaging.py builds the wheel and checks it holds the whole tree.
"""

from pathlib import Path

from setuptools import find_packages, setup

FOLDERS = ("proto", "transfer", "router", "cluster", "bench")  # the users' layout
SKIP = {"__pycache__"}


def _packages() -> tuple[list[str], dict[str, str], dict[str, list[str]]]:
    packages, package_dir, package_data = [], {}, {}
    for folder in FOLDERS:
        package_dir[f"pdcluster.{folder}"] = folder
        found = [folder, *(f"{folder}.{p}" for p in find_packages(folder))]
        packages += [f"pdcluster.{name}" for name in found]
        for name in found:
            here = Path(*name.split("."))
            # This package's files that are not modules of it: plain files beside its modules, and
            # whole folders that are no package of their own (no __init__.py).
            data = [f.name for f in here.iterdir() if f.is_file() and f.suffix != ".py"]
            for sub in here.iterdir():
                if sub.is_dir() and sub.name not in SKIP and not (sub / "__init__.py").exists():
                    data += [str(f.relative_to(here)) for f in sub.rglob("*")
                             if f.is_file() and not SKIP & set(f.parts)]
            if data:
                package_data[f"pdcluster.{name}"] = sorted(data)
    return packages, package_dir, package_data


packages, package_dir, package_data = _packages()
setup(packages=packages, package_dir=package_dir, package_data=package_data)
