"""The shape of the tree. The folders depend one way (docs/architecture.md, "Layers"): every
import, those inside functions too, goes to the module's own folder or one below it; bench/ is on
top and no product module imports it; the engines import nothing of the router; and no file is
over 400 lines."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Lowest first: the contracts, moving bytes and proving peers, the router, the engines, the
# launcher and the tools (the cluster), the benchmarks.
LAYERS = ("proto", "transfer", "router", "cluster", "bench")
# The engines (what runs inside a P or D instance) sit in cluster/ beside the launcher: they
# import nothing of the router, which talks to them only through proto/ and transfer/.
ENGINE_MODULES = ("cluster/engine_actor.py", "cluster/engine_stats.py", "cluster/reference_engine.py",
                  "cluster/vllm_*.py", "cluster/vllm_site/*.py", "cluster/start_diagnosis.py", "cluster/sim/*.py")
NOT_ENGINE = {"cluster/sim/fit.py", "cluster/sim/fit_cli.py", "cluster/sim/fit_output.py", "cluster/sim/fit_variation.py",
              "cluster/sim/plan.py", "cluster/sim/plan_report.py",
              "cluster/sim/plan_anatomy.py", "cluster/sim/plan_headroom.py", "cluster/sim/plan_provenance.py",
              "cluster/sim/plan_types.py", "cluster/sim/plan_rank.py",
              "cluster/sim/calibrate.py",
              "cluster/sim/seed002_fit.py"}  # planning tools kept beside the model


def project_imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every `pdcluster.*` import in a file, at any depth."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        out += [(node.lineno, n) for n in names[:1] if n.startswith("pdcluster.")]
    return out


def layer_violations(root: Path, layers: tuple[str, ...] = LAYERS) -> list[str]:
    rank = {name: k for k, name in enumerate(layers)}
    bad = []
    for folder in layers:
        for path in sorted((root / folder).rglob("*.py")):
            for line, module in project_imports(path):
                target = module.split(".")[1]
                if target in rank and rank[target] > rank[folder]:
                    bad.append(f"{path.relative_to(root)}:{line} imports {module} ({folder}/ is below {target}/)")
    return bad


def engine_files(root: Path) -> list[Path]:
    files = {p for pattern in ENGINE_MODULES for p in root.glob(pattern)}
    return sorted(p for p in files if str(p.relative_to(root)) not in NOT_ENGINE)


def test_every_import_goes_to_the_same_folder_or_below():
    assert not layer_violations(ROOT), "\n".join(layer_violations(ROOT))


def test_the_engines_import_nothing_of_the_router():
    files = engine_files(ROOT)
    assert ROOT / "cluster/engine_actor.py" in files and ROOT / "cluster/sim/scheduler_core.py" in files
    bad = [f"{p.relative_to(ROOT)}:{line} imports {m}" for p in files for line, m in project_imports(p)
           if m.startswith(("pdcluster.router", "pdcluster.bench"))]
    assert not bad, "\n".join(bad)


def test_every_folder_is_in_a_layer_and_installed():
    folders = {p.parent.relative_to(ROOT).parts[0] for p in ROOT.glob("*/__init__.py")}
    assert folders - {"tests"} == set(LAYERS)
    # setup.py finds the packages under the folders it names (tests/test_packaging.py checks the wheel).
    [names] = [ast.literal_eval(n.value) for n in ast.parse((ROOT / "setup.py").read_text()).body
               if isinstance(n, ast.Assign) and [getattr(t, "id", None) for t in n.targets] == ["FOLDERS"]]
    assert set(names) == set(LAYERS)


def test_a_violation_is_found_at_any_depth(tmp_path):
    """The checker itself: an import inside a function, up the layers, is named with its line."""
    for folder in ("proto", "router"):
        (tmp_path / folder).mkdir()
    (tmp_path / "proto" / "types.py").write_text("import os\n\n\ndef f():\n    from pdcluster.router.x import y\n")
    (tmp_path / "router" / "x.py").write_text("from pdcluster.proto.types import f\n")
    assert layer_violations(tmp_path, ("proto", "router")) == [
        "proto/types.py:5 imports pdcluster.router.x (proto/ is below router/)"]


MAX_LINES = 400  # past it, a file is split along its ideas before it grows


def test_no_hand_written_source_file_is_over_400_lines():
    files = [p for folder in (*LAYERS, "tests") for p in (ROOT / folder).rglob("*.py")
             if not p.name.endswith(("_pb2.py", "_pb2_grpc.py"))]
    assert len(files) > 200
    long = sorted(f"{p.relative_to(ROOT)}: {n} lines" for p in files if (n := len(p.read_text().splitlines())) > MAX_LINES)
    assert not long, "\n".join(long)
