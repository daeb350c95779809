"""Structured outputs: a request's `structured_outputs` (vLLM's) and `response_format` (OpenAI's)
read into one constraint for D's vLLM (proto StructuredSpec), as vLLM's server reads them
(vllm/entrypoints/openai/*/protocol.py, vllm/entrypoints/generate/base/protocol.py, 0.32):
`response_format` json_object / json_schema / structural_tag overrides `structured_outputs`' constraint; at most
one of json, regex, choice, grammar, json_object, structural_tag. The older `guided_json`,
`guided_regex`, `guided_choice`, `guided_grammar` and `guided_whitespace_pattern` (which vLLM
before 0.12 read, and which clients written for it still send) mean their `structured_outputs`
fields: vLLM 0.32 drops them unread, the router does not serve a request without what it asked.
What only vLLM's grammar compiler can judge (a schema it does not support, a regex it cannot
compile) D's vLLM refuses as the request reaches it: a 400 still (router/lifecycle.py), after P's
prefill.
"""

from __future__ import annotations

import json
from typing import Any

from pdcluster.proto.messages import StructuredSpec
from pdcluster.router.openai_models import ApiError

KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar",
          "guided_whitespace_pattern": "whitespace_pattern"}  # the older field -> structured_outputs' own
OPTIONS = ("disable_any_whitespace", "disable_additional_properties", "whitespace_pattern")
MAX_SPEC_CHARS = 1 << 20  # a schema, regex or grammar as JSON text: D compiles it


def structured_spec(structured_outputs: Any, response_format: Any, logits: bool,
                    guided: dict[str, Any] | None = None) -> StructuredSpec | None:
    """The request's constraint, or None; ApiError naming the field for what vLLM refuses.
    `guided`: the request's guided_* fields (GUIDED's keys) that are set."""
    if guided:
        if structured_outputs is not None:
            raise ApiError(f"give structured_outputs or the older {', '.join(guided)}, not both",
                           param=next(iter(guided)))
        structured_outputs = {GUIDED[k]: v for k, v in guided.items()}
    given = _given(structured_outputs)
    override = _from_response_format(response_format)
    if given is None and override is None:
        return None
    if not logits:
        raise ApiError("structured outputs: the simulated engine's tokens are synthetic",
                       param="response_format" if override else "structured_outputs")
    fields = {**(given or {}), **(override or {})}
    if override:  # response_format's constraint replaces structured_outputs' (vLLM's dataclass replace)
        fields = {k: v for k, v in fields.items() if k not in KINDS or k in override}
    if sum(fields.get(k) is not None for k in KINDS) != 1:
        raise ApiError("You can only use one kind of structured outputs constraint ('json', 'regex', 'choice', "
                       "'grammar', 'json_object' or 'structural_tag')", param="structured_outputs")
    choice = fields.get("choice")
    if choice is not None and not (isinstance(choice, list) and choice and all(isinstance(c, str) for c in choice)):
        raise ApiError("structured_outputs.choice must be a non-empty list of strings", param="structured_outputs")
    for key in ("regex", "grammar", "whitespace_pattern", "structural_tag"):
        if fields.get(key) is not None and not isinstance(fields[key], str):
            raise ApiError(f"structured_outputs.{key} must be a string", param="structured_outputs")
    schema = fields.get("json")
    if schema is not None:
        if isinstance(schema, str):  # vLLM takes a schema as a dict or as its JSON text
            try:
                schema = json.loads(schema)
            except ValueError as err:
                raise ApiError(f"structured_outputs.json is not valid JSON: {err}", param="structured_outputs") from None
        if not isinstance(schema, dict | bool):
            raise ApiError("a JSON schema must be an object", param="structured_outputs")
        schema = json.dumps(schema)
    text = sum(len(x) for x in (schema, fields.get("regex"), fields.get("grammar"), fields.get("structural_tag")) if x) \
        + sum(map(len, choice or ()))
    if text > MAX_SPEC_CHARS:
        raise ApiError(f"the structured outputs constraint is {text} characters, at most {MAX_SPEC_CHARS}",
                       param="structured_outputs")
    return StructuredSpec(json=schema, regex=fields.get("regex"), choice=None if choice is None else tuple(choice),
                          grammar=fields.get("grammar"), json_object=fields.get("json_object"),
                          disable_any_whitespace=bool(fields.get("disable_any_whitespace")),
                          disable_additional_properties=bool(fields.get("disable_additional_properties")),
                          whitespace_pattern=fields.get("whitespace_pattern"),
                          structural_tag=fields.get("structural_tag"))


def _given(structured_outputs: Any) -> dict[str, Any] | None:
    if structured_outputs is None:
        return None
    if not isinstance(structured_outputs, dict):
        raise ApiError("structured_outputs must be an object", param="structured_outputs")
    if unknown := set(structured_outputs) - set(KINDS) - set(OPTIONS):
        raise ApiError(f"structured_outputs: unknown field(s) {sorted(unknown)}", param="structured_outputs")
    return dict(structured_outputs)


def _from_response_format(response_format: Any) -> dict[str, Any] | None:
    if response_format is None:
        return None
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict):
            raise ApiError("When response_format type is 'json_schema', the 'json_schema' field must be provided.",
                           param="response_format")
        return {"json": spec.get("schema")}
    if kind == "structural_tag":
        return {"structural_tag": json.dumps(_structural_tag_format(response_format))}
    raise ApiError(f"response_format type {kind!r} is not supported: 'text', 'json_object', 'json_schema' "
                   "or 'structural_tag'", param="response_format")


def _structural_tag_format(response_format: dict[str, Any]) -> dict[str, Any]:
    """The tag as vLLM dumps its response format model (by alias, extra fields kept): xgrammar's
    own (`format`) or the older `structures` + `triggers`, whose structures' `schema` defaults to null."""
    structures, triggers = response_format.get("structures"), response_format.get("triggers")
    legacy = (isinstance(structures, list) and isinstance(triggers, list) and all(isinstance(t, str) for t in triggers)
              and all(isinstance(x, dict) and isinstance(x.get("begin"), str) and isinstance(x.get("end"), str)
                      and isinstance(x.get("schema"), dict | None) for x in structures))
    if legacy:
        return {"type": "structural_tag", **response_format,
                "structures": [{"begin": x["begin"], "schema": x.get("schema"), "end": x["end"], **x} for x in structures]}
    if "format" in response_format:
        return {"type": "structural_tag", **response_format}
    raise ApiError("Invalid response_format structural_tag specification.", param="response_format")
