"""Structured outputs read from a request (router/structured_outputs.py) as vLLM's server reads
them, and carried to D in the SamplingSpec."""

from __future__ import annotations

import json

import pytest

from pdcluster.proto.messages import StructuredSpec
from pdcluster.router.openai_models import ApiError
from pdcluster.router.structured_outputs import structured_spec

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
TAG = json.dumps({"type": "structural_tag", "format": {"type": "const_string", "value": "ok"}})


@pytest.mark.parametrize("structured, response_format, want", [
    (None, None, None),
    (None, {"type": "text"}, None),
    (None, {"type": "json_object"}, StructuredSpec(json_object=True)),
    (None, {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}}, StructuredSpec(json=json.dumps(SCHEMA))),
    ({"json": json.dumps(SCHEMA)}, None, StructuredSpec(json=json.dumps(SCHEMA))),
    ({"choice": ["yes", "no"], "disable_any_whitespace": True}, None,
     StructuredSpec(choice=("yes", "no"), disable_any_whitespace=True)),
    ({"regex": "[a-z]+"}, {"type": "json_object"}, StructuredSpec(json_object=True)),  # response_format wins
    ({"grammar": "root ::= \"a\""}, None, StructuredSpec(grammar="root ::= \"a\"")),
    ({"structural_tag": TAG}, None, StructuredSpec(structural_tag=TAG)),
])
def test_the_constraint_d_gets(structured, response_format, want):
    assert structured_spec(structured, response_format, logits=True) == want


LEGACY = {"type": "structural_tag", "structures": [{"begin": "<a>", "end": "</a>"}], "triggers": ["<a"]}
XGRAMMARS = {"type": "structural_tag", "format": {"type": "const_string", "value": "ok"}, "extra": 1}


@pytest.mark.parametrize("response_format", [LEGACY, XGRAMMARS], ids=["legacy", "xgrammar's"])
def test_a_structural_tag_response_format_is_the_tag_vllm_makes_of_it(response_format):
    from pydantic import TypeAdapter
    from vllm.entrypoints.generate.base.protocol import AnyResponseFormat, structured_outputs_from_response_format

    theirs = structured_outputs_from_response_format(None, TypeAdapter(AnyResponseFormat).validate_python(response_format))
    ours = structured_spec({"regex": "x"}, response_format, logits=True)
    assert json.loads(ours.structural_tag) == json.loads(theirs.structural_tag)
    assert ours == StructuredSpec(structural_tag=ours.structural_tag)  # it replaces structured_outputs' regex


@pytest.mark.parametrize("response_format", [
    {"type": "structural_tag"},
    {"type": "structural_tag", "structures": [{"begin": "<a>"}], "triggers": ["<a"]},
    {"type": "structural_tag", "structures": [], "triggers": "<a"},
])
def test_a_malformed_structural_tag_is_vllms_400(response_format):
    with pytest.raises(ApiError, match="Invalid response_format structural_tag specification") as err:
        structured_spec(None, response_format, logits=True)
    assert err.value.param == "response_format"


def test_the_simulated_engine_refuses_them():
    with pytest.raises(ApiError, match="simulated engine"):
        structured_spec({"regex": "a"}, None, logits=False)
    assert structured_spec(None, {"type": "text"}, logits=False) is None


def test_the_request_carries_it_to_the_backend(fake_router):
    client, backend = fake_router()
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                  "response_format": {"type": "json_schema",
                                                                      "json_schema": {"name": "n", "schema": SCHEMA}}})
    assert r.status_code == 200, r.text
    assert json.loads(backend.calls[0][2].structured.json) == SCHEMA


@pytest.mark.parametrize("guided, want", [
    ({"guided_json": SCHEMA}, StructuredSpec(json=json.dumps(SCHEMA))),
    ({"guided_regex": "[a-z]+", "guided_whitespace_pattern": " "}, StructuredSpec(regex="[a-z]+", whitespace_pattern=" ")),
    ({"guided_choice": ["a", "b"]}, StructuredSpec(choice=("a", "b"))),
    ({"guided_grammar": "root ::= \"a\""}, StructuredSpec(grammar="root ::= \"a\"")),
])
def test_the_older_guided_fields_mean_their_structured_outputs_fields(fake_router, guided, want):
    client, backend = fake_router()
    r = client.post("/v1/completions", json={"prompt": "a", **guided})
    assert r.status_code == 200, r.text
    assert backend.calls[0][2].structured == want


def test_guided_fields_beside_structured_outputs_are_a_400(fake_router):
    client, backend = fake_router()
    r = client.post("/v1/completions", json={"prompt": "a", "guided_regex": "a", "structured_outputs": {"regex": "b"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "guided_regex" and backend.calls == []
    with pytest.raises(ApiError, match="only use one kind"):
        structured_spec(None, None, True, {"guided_regex": "a", "guided_choice": ["a"]})
