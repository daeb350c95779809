"""Post-import hooks: change a vLLM module right after it is first imported.

A patch that replaces something inside a vLLM module registers `after_import(module,
hook)`: the hook runs right after that module is executed by its own loader (or at once,
if it already is), so a process that never imports the module never pays for it, and
importing this module imports neither vLLM nor torch.
"""

from __future__ import annotations

import importlib.abc
import logging
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)


_lock = threading.RLock()


class PatchError(RuntimeError):
    """vLLM is not what a patch was written for: the patch would be wrong, so the engine stops."""


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs callbacks right after a named module is executed by its own loader."""

    def __init__(self):
        self.hooks: dict[str, list[Callable]] = {}

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in self.hooks:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _HookedLoader(spec.loader, self.hooks.pop(fullname))
        return spec


class _HookedLoader(importlib.abc.Loader):
    def __init__(self, loader, hooks: list[Callable]):
        self.loader, self.hooks = loader, hooks

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        module.__loader__ = self.loader  # as if we had never been there
        if module.__spec__ is not None:
            module.__spec__.loader = self.loader
        self.loader.exec_module(module)
        for hook in self.hooks:
            hook(module)

    def __getattr__(self, name):  # get_source, is_package, ... of the real loader
        return getattr(self.loader, name)


_finder = _AfterImport()


def after_import(module_name: str, hook: Callable) -> None:
    """Call `hook(module)` once `module_name` is imported (now, if it already is)."""
    with _lock:
        module = sys.modules.get(module_name)
        if module is not None:
            hook(module)
            return
        _finder.hooks.setdefault(module_name, []).append(hook)
        if _finder not in sys.meta_path:
            sys.meta_path.insert(0, _finder)


def replace(owner, name: str, new, what: str) -> None:
    """Set `owner.name` to `new`; PatchError if vLLM no longer has it (the patch would do nothing)."""
    if not hasattr(owner, name):
        raise PatchError(f"pdcluster.vllm_patches: {what}: {getattr(owner, '__name__', owner)}.{name} is gone "
                         f"; update cluster/vllm_patches*.py")
    setattr(owner, name, new)


@dataclass(frozen=True)
class Patch:
    """One change to vLLM, and the vLLM versions it applies to: those whose source (read for
    each, cluster/vllm_sources.py) still has the bug and the `target` it replaces. The
    conformance tests check `target` (and `source_text`) in `module` for each of `versions`."""

    name: str
    hook: Callable  # hook(module) once `module` is imported; hook() at once if module is None
    versions: tuple[str, ...]
    module: str | None = None  # the module it changes; None: it changes nothing in vLLM (os, nixl, triton)
    target: str | None = None  # what it replaces in `module`: 'name' or 'Class.attr'
    source_text: str | None = None  # text the source must hold for the patch to mean anything
    source: str | None = None  # the vLLM module that holds the bug, when the patch changes another

    @property
    def source_module(self) -> str | None:
        return self.source or self.module

    def install(self, version: str) -> bool:
        """Install it if `version` is one of its versions; whether it was."""
        if version not in self.versions:
            log.info("vLLM %s: patch %s not needed (applies to %s)", version, self.name, ", ".join(self.versions))
            return False
        if self.module is None:
            self.hook()
        else:
            after_import(self.module, self.hook)
        return True
