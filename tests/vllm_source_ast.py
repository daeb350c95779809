"""Read a vLLM version's source without importing it: which names a module defines, a class's
members (with those of the bases it names), its abstract methods, and whether an override's
signature accepts what the base's callers pass."""

from __future__ import annotations

import ast
import functools
import os
from dataclasses import dataclass
from pathlib import Path

import pytest

from pdcluster.cluster.vllm_sources import fetch_command, source_path


def fetched(name: str) -> Path:
    """A fetched source's root; else a skip naming the command (offline), or a failure where
    PDC_REQUIRE_VLLM_SOURCES=1 (CI: .ci/run sets it, so the conformance tests cannot skip)."""
    root = source_path(name)
    if root is None:
        message = f"{name}'s source is not fetched (offline?): {fetch_command(name)}"
        if os.environ.get("PDC_REQUIRE_VLLM_SOURCES") == "1":
            pytest.fail(message)
        pytest.skip(message)
    return root


@dataclass(frozen=True)
class Params:
    positional: tuple[str, ...]  # after self / cls
    keyword_only: tuple[str, ...]
    defaults: int  # how many trailing positional ones have defaults
    varargs: bool
    varkw: bool

    @classmethod
    def of(cls, fn: ast.FunctionDef | ast.AsyncFunctionDef) -> Params:
        a = fn.args
        names = [p.arg for p in a.posonlyargs + a.args]
        is_static = any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in fn.decorator_list)
        if names and not is_static:
            names = names[1:]  # self / cls
        return cls(tuple(names), tuple(p.arg for p in a.kwonlyargs), len(a.defaults),
                   a.vararg is not None, a.kwarg is not None)


def incompatibility(base: Params, override: Params) -> str | None:
    """Why `override` cannot stand in for `base` when called as the base is, or None."""
    for i, name in enumerate(base.positional):
        if i < len(override.positional):
            if override.positional[i] != name:
                return f"parameter {i + 1} is {override.positional[i]!r}, the base's is {name!r}"
        elif not override.varargs:
            return f"missing parameter {name!r}"
    required_extra = len(override.positional) - override.defaults
    if required_extra > len(base.positional):
        return f"requires {override.positional[len(base.positional):required_extra]}, which the base does not pass"
    for name in base.keyword_only:
        if name not in override.keyword_only and name not in override.positional and not override.varkw:
            return f"missing keyword parameter {name!r}"
    if base.varkw and not override.varkw:
        return "takes no **kwargs, which the base's callers may pass"
    return None


class Source:
    """One version's source tree (its root holds vllm/)."""

    def __init__(self, root: Path):
        self.root = root

    def module_file(self, module: str) -> Path | None:
        base = self.root.joinpath(*module.split("."))
        for path in (base.with_suffix(".py"), base / "__init__.py"):
            if path.exists():
                return path
        return None

    @functools.cache  # noqa: B019  (a Source lives as long as the test session)
    def tree(self, module: str) -> ast.Module | None:
        path = self.module_file(module)
        return ast.parse(path.read_text(), str(path)) if path else None

    def top_level(self, module: str) -> dict[str, ast.AST]:
        """Names a module binds at top level (defs, classes, assignments, imports)."""
        tree = self.tree(module)
        out: dict[str, ast.AST] = {}
        for node in tree.body if tree else ():
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                out[node.name] = node
            elif isinstance(node, ast.Assign):
                for target in node.targets:
                    if isinstance(target, ast.Name):
                        out[target.id] = node
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                out[node.target.id] = node
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                for alias in node.names:
                    out[alias.asname or alias.name.split(".")[0]] = node
        return out

    def find_class(self, module: str, name: str, depth: int = 0) -> tuple[str, ast.ClassDef] | None:
        """The class `name` as `module` binds it, following `from x import name` (re-exports)."""
        node = self.top_level(module).get(name)
        if isinstance(node, ast.ClassDef):
            return module, node
        if isinstance(node, ast.ImportFrom) and depth < 5:
            source = _absolute(module, node, self.module_file(module))
            original = next(a.name for a in node.names if (a.asname or a.name) == name)
            return self.find_class(source, original, depth + 1)
        return None

    def members(self, module: str, cls_name: str) -> dict[str, ast.AST]:
        """A class's members, its bases' (those it names that this source has) below its own."""
        found = self.find_class(module, cls_name)
        if found is None:
            return {}
        where, cls = found
        out: dict[str, ast.AST] = {}
        for base in cls.bases:
            if isinstance(base, ast.Name) and base.id not in ("ABC", "object", "Generic"):
                out.update(self.members(where, base.id))
        for node in cls.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out[node.name] = node
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                out[node.target.id] = node
            elif isinstance(node, ast.Assign):
                for target in node.targets:
                    if isinstance(target, ast.Name):
                        out[target.id] = node
        return out

    def defines(self, module: str, name: str) -> ast.AST | None:
        """`module`'s `name` ('X' or 'Class.attr'), or None if this version has no such thing."""
        if "." not in name:
            return self.top_level(module).get(name)
        cls_name, attr = name.split(".", 1)
        return self.members(module, cls_name).get(attr)

    def abstract_methods(self, module: str, cls_name: str) -> dict[str, Params]:
        return {name: Params.of(node) for name, node in self.members(module, cls_name).items()
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _is_abstract(node)}

    def methods(self, module: str, cls_name: str) -> dict[str, Params]:
        return {name: Params.of(node) for name, node in self.members(module, cls_name).items()
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}


def own_methods(path: Path, cls_name: str) -> dict[str, Params]:
    """The methods a class of the project's own source defines in its body."""
    tree = ast.parse(path.read_text(), str(path))
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls_name)
    return {n.name: Params.of(n) for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


def _is_abstract(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    for d in fn.decorator_list:
        if (isinstance(d, ast.Name) and d.id == "abstractmethod") or (
                isinstance(d, ast.Attribute) and d.attr == "abstractmethod"):
            return True
    return False


def _absolute(module: str, node: ast.ImportFrom, path: Path | None) -> str:
    if not node.level:
        return node.module or ""
    package = module.split(".")
    if path is not None and path.name != "__init__.py":
        package = package[:-1]
    package = package[:len(package) - (node.level - 1)]
    return ".".join(package + ([node.module] if node.module else []))
