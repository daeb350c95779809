"""docs/spec.md, the cluster spec's every field, generated from its pydantic models (proto/spec.py,
proto/spec_sections.py, proto/router_spec.py): `python -m pdcluster.cluster.spec_doc > docs/spec.md`.
A field's text is its `description`, else the comment beside it (or the comment lines right above
it) in the model's source; tests/test_spec_doc.py checks that docs/spec.md is what this writes."""

from __future__ import annotations

import inspect
import re
import typing
from collections.abc import Iterator

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from pdcluster.proto.spec import ClusterSpec

_FIELD = re.compile(r"^\s+(\w+)\s*:\s*[^#]*?(?:#\s*(.*))?$")
_COMMENT = re.compile(r"^\s+#\s?(.*)$")


def _comments(cls: type[BaseModel]) -> dict[str, str]:
    """field -> the comment beside its line in the class's source, else the comments just above it."""
    out: dict[str, str] = {}
    above: list[str] = []
    for line in inspect.getsource(cls).splitlines()[1:]:
        if m := _COMMENT.match(line):
            above.append(m[1].strip())
            continue
        if (m := _FIELD.match(line)) and m[1] in cls.model_fields:
            out[m[1]] = (m[2] or " ".join(above)).strip()
        above = []
    return out


def _model_of(annotation) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        if (found := _model_of(arg)) is not None:
            return found
    return None


def _type(annotation) -> str:
    text = getattr(annotation, "__name__", None) if isinstance(annotation, type) else None
    text = text or str(annotation).replace("typing.", "")
    return re.sub(r"pdcluster\.[\w.]+\.", "", text).replace("NoneType", "None")


def _default(field) -> str:
    if field.default is PydanticUndefined:
        return "*required*" if field.default_factory is None else f"`{field.default_factory()!r}`"
    if isinstance(field.default, BaseModel):
        return "(its section)"
    return f"`{field.default!r}`"


def sections(cls: type[BaseModel] = ClusterSpec, path: str = "",
             defaults: BaseModel | None = None) -> Iterator[tuple[str, type[BaseModel], list]]:
    """(dotted section path, its model, [(field, type, default, text)]), depth first. `defaults`:
    the section's default as its parent gives it (the shared `engine:` is DEFAULT_ENGINE's)."""
    comments = _comments(cls)
    rows, nested = [], []
    for name, field in cls.model_fields.items():
        sub = _model_of(field.annotation)
        text = (field.description or comments.get(name, "")).replace("|", "\\|")
        default = f"`{getattr(defaults, name)!r}`" if defaults is not None and not sub else _default(field)
        if sub is not None and not text:
            text = f"its section: `{path}{name}` below"
        rows.append((name, "section" if sub else _type(field.annotation), "" if sub else default, text))
        if sub is not None and sub is not cls:
            inner = getattr(defaults, name, None) if defaults is not None else field.default
            nested.append((f"{path}{name}", sub, inner if isinstance(inner, BaseModel) else None))
    yield path.rstrip(".") or "(top level)", cls, rows
    for sub_path, sub, inner in nested:
        yield from sections(sub, f"{sub_path}.", inner)


def render() -> str:
    lines = ["# The cluster spec, field by field", "",
             "Generated from the spec's pydantic models by `python -m pdcluster.cluster.spec_doc > docs/spec.md`",
             "(tests/test_spec_doc.py keeps it current). Example specs with every field commented: deploy/*.yaml;",
             "`pdc check SPEC` validates one without launching it. A role's `engine:` (`prefill.engine`,",
             "`decode.engine`) takes the same fields as the shared `engine:` and overrides them; `engine.extra`",
             "passes any other vLLM engine argument (`AsyncEngineArgs`: tensor or expert parallel size,",
             "quantization, speculative decoding) to vLLM as is.", ""]
    seen: set[type] = set()
    for path, cls, rows in sections():
        if cls in seen:
            continue  # a model used in two places (a role's engine is the shared engine's)
        seen.add(cls)
        own = cls.__dict__.get("__doc__") or ""  # not BaseModel's
        doc = inspect.cleandoc(own).split("\n\n")[0].replace("\n", " ")
        lines += [f"## `{path}`", ""] + ([doc, ""] if doc and cls is not ClusterSpec else [])
        lines += ["| field | type | default | what it is |", "|---|---|---|---|"]
        lines += [f"| `{n}` | {t.replace('|', chr(92) + '|')} | {d} | {x} |" for n, t, d, x in rows]
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    print(render(), end="")
