"""docs/architecture.md names real things: every `path` and `path:Name.attr` it cites exists,
and its module map lists every module of the product."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "architecture.md"
REF = re.compile(r"`((?:proto|transfer|router|cluster|bench|tests|deploy|docs)/[\w/.-]+\.\w+)(?::([\w.]+))?`")
PRODUCT = ("proto", "transfer", "router", "cluster")


def references(text: str) -> list[tuple[str, str | None]]:
    return [(m[1], m[2]) for m in REF.finditer(text)]


def defined_names(path: Path) -> set[str]:
    """Every class and function of a module by its dotted path inside it (`Class.method`,
    `function.inner`)."""
    names: set[str] = set()

    def walk(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                names.add(prefix + child.name)
                walk(child, f"{prefix}{child.name}.")
            elif isinstance(child, (ast.Assign, ast.AnnAssign)) and not prefix:
                targets = child.targets if isinstance(child, ast.Assign) else [child.target]
                names.update(t.id for t in targets if isinstance(t, ast.Name))

    walk(ast.parse(path.read_text()), "")
    return names


def missing(root: Path, text: str) -> list[str]:
    out = []
    for file, name in references(text):
        path = root / file
        if not path.exists():
            out.append(f"{file}: no such file")
        elif name and name not in defined_names(path):
            out.append(f"{file}:{name}: not defined there")
    return out


def test_every_file_and_function_the_document_names_exists():
    refs = references(DOC.read_text())
    assert len(refs) > 150  # the map and the sequence were read
    assert not missing(ROOT, DOC.read_text()), "\n".join(missing(ROOT, DOC.read_text()))


def test_the_module_map_lists_every_module():
    named = {file for file, _ in references(DOC.read_text())}
    modules = {str(p.relative_to(ROOT)) for folder in PRODUCT for p in (ROOT / folder).rglob("*.py")
               if p.name != "__init__.py" and not p.name.endswith(("_pb2.py", "_pb2_grpc.py"))}
    assert not sorted(modules - named), f"modules the map does not name: {sorted(modules - named)}"


def test_the_check_finds_a_wrong_name(tmp_path):
    (tmp_path / "router").mkdir()
    (tmp_path / "router" / "a.py").write_text("class A:\n    def f(self):\n        def g():\n            pass\n")
    text = "`router/a.py:A.f.g` `router/a.py:A.h` `router/b.py` `router/a.py`"
    assert missing(tmp_path, text) == ["router/a.py:A.h: not defined there", "router/b.py: no such file"]
