"""Side by side with vLLM's own server (issue 30): `vllm serve`'s OpenAI server, started from the
installed vLLM's entry point on the tiny model (one engine, no P/D), and the P1D1 cluster receive
the same requests, at temperature 0 or with a seed, streamed and not. Their answers must be equal:
text, token ids, finish reasons, usage's counts, logprobs within 1e-3; ids and timestamps aside;
and the official `openai` client must parse each of ours into its typed objects."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from e2e import (
    PARSERS,
    assert_no_kv_in_use,
    free_port,
    p1d1_spec,
    shared_cluster,
    tiny_model_dir,
    transfer_as,
    wait_until,
)

pytestmark = [pytest.mark.e2e, pytest.mark.local_ray, pytest.mark.shared_cluster("p1d1")]

MODEL = "tiny-qwen3"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
    "additionalProperties": False}}}, {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {}, "additionalProperties": False}}}]
PROMPT = "The quick brown fox jumps over the lazy dog; " * 12
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me about foxes and dogs."}]

SMALL_SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
                "required": ["n"], "additionalProperties": False}
# (name, endpoint, body): each answered by both servers, compared by `answer`'s fields.
CORPUS = [
    ("plain", "completions", {"prompt": PROMPT, "max_tokens": 12}),
    ("token ids", "completions", {"prompt": list(range(5, 300)), "max_tokens": 8, "return_token_ids": True}),
    ("seeded sample", "completions", {"prompt": PROMPT, "max_tokens": 12, "temperature": 0.9, "seed": 7}),
    ("stop string", "completions", {"prompt": PROMPT, "max_tokens": 24, "stop": ["e", " t"]}),
    ("stop token", "completions", {"prompt": PROMPT, "max_tokens": 24, "stop_token_ids": "the plain answer's 3rd"}),
    ("logprobs 0", "completions", {"prompt": PROMPT, "max_tokens": 6, "logprobs": 0}),
    ("logprobs 3", "completions", {"prompt": PROMPT, "max_tokens": 6, "logprobs": 3}),
    ("prompt logprobs 0", "completions", {"prompt": PROMPT, "max_tokens": 2, "prompt_logprobs": 0}),
    ("prompt logprobs 5", "completions", {"prompt": PROMPT, "max_tokens": 2, "prompt_logprobs": 5}),
    ("echo with logprobs", "completions", {"prompt": PROMPT, "max_tokens": 4, "echo": True, "logprobs": 1}),
    ("penalties", "completions", {"prompt": PROMPT, "max_tokens": 12, "frequency_penalty": 1.5,
                                  "presence_penalty": 1.0, "repetition_penalty": 1.3, "min_p": 0.05,
                                  "min_tokens": 4}),
    ("n=3", "completions", {"prompt": PROMPT, "max_tokens": 8, "n": 3, "temperature": 0.5, "seed": 3,
                            "return_token_ids": True}),
    ("n=3 seeded", "completions", {"prompt": PROMPT, "max_tokens": 8, "n": 3, "temperature": 1.0, "seed": 11,
                                   "logprobs": 1}),
    ("chat n=2 seeded", "chat/completions", {"messages": CHAT, "max_tokens": 8, "n": 2, "temperature": 1.0, "seed": 5}),
    ("json schema", "chat/completions", {"messages": CHAT, "max_tokens": 40, "response_format": {
        "type": "json_schema", "json_schema": {"name": "animal", "schema": {
            "type": "object", "properties": {"name": {"type": "string", "maxLength": 6}, "legs": {"type": "integer"}},
            "required": ["name", "legs"], "additionalProperties": False}}}}),
    ("json object", "completions", {"prompt": PROMPT, "max_tokens": 16, "response_format": {"type": "json_object"}}),
    ("choice", "completions", {"prompt": PROMPT, "max_tokens": 8, "structured_outputs": {"choice": ["fox", "dog", "cat"]}}),
    ("regex", "completions", {"prompt": PROMPT, "max_tokens": 12, "structured_outputs": {"regex": "[a-z]{3,6}-[0-9]{2}"}}),
    ("guided json", "completions", {"prompt": PROMPT, "max_tokens": 30, "guided_json": SMALL_SCHEMA}),
    ("structural tag", "completions", {"prompt": PROMPT, "max_tokens": 12, "structured_outputs": {
        "structural_tag": json.dumps({"type": "structural_tag", "format": {
            "type": "tag", "begin": "<n>", "content": {"type": "regex", "pattern": "[0-9]{1,3}"}, "end": "</n>"}})}}),
    ("response_format structural tag", "chat/completions", {"messages": CHAT, "max_tokens": 12, "response_format": {
        "type": "structural_tag", "format": {
            "type": "tag", "begin": "<n>", "content": {"type": "regex", "pattern": "[0-9]{1,3}"}, "end": "</n>"}}}),
    ("response_format legacy tag", "completions", {"prompt": PROMPT, "max_tokens": 12, "response_format": {
        "type": "structural_tag", "structures": [{"begin": "<n>", "schema": {"type": "integer"}, "end": "</n>"}],
        "triggers": ["<"]}}),
    ("logit bias", "completions", {"prompt": PROMPT, "max_tokens": 4, "logit_bias": {"300": 100}}),
    ("allowed ids", "completions", {"prompt": PROMPT, "max_tokens": 6, "allowed_token_ids": [300, 301, 302, 303]}),
    ("bad words", "completions", {"prompt": PROMPT, "max_tokens": 12, "bad_words": ["the", " fox", "e"]}),
    ("chat", "chat/completions", {"messages": CHAT, "max_tokens": 12}),
    ("chat logprobs", "chat/completions", {"messages": CHAT, "max_tokens": 6, "logprobs": True, "top_logprobs": 2}),
    ("chat list content", "chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "Tell me"}, {"type": "text", "text": "about foxes."}]}], "max_tokens": 8}),
    ("chat continued", "chat/completions", {"messages": [*CHAT, {"role": "assistant", "content": "Foxes are"}],
                                            "max_tokens": 8, "add_generation_prompt": False,
                                            "continue_final_message": True}),
    ("chat prompt logprobs", "chat/completions", {"messages": CHAT, "max_tokens": 2, "prompt_logprobs": 2}),
    # hermes' tool parser and deepseek_v3's reasoning parser on both (tests/e2e.py PARSERS)
    ("tools auto", "chat/completions", {"messages": CHAT, "max_tokens": 16, "tools": TOOLS}),
    ("tools none", "chat/completions", {"messages": CHAT, "max_tokens": 8, "tools": TOOLS, "tool_choice": "none"}),
    ("tools required", "chat/completions", {"messages": CHAT, "max_tokens": 60, "tools": TOOLS,
                                            "tool_choice": "required"}),
    ("tools named", "chat/completions", {"messages": CHAT, "max_tokens": 60, "tools": TOOLS, "tool_choice": {
        "type": "function", "function": {"name": "get_weather"}}}),
    ("tools one call", "chat/completions", {"messages": CHAT, "max_tokens": 60, "tools": TOOLS,
                                            "tool_choice": "required", "parallel_tool_calls": False}),
    ("tool history", "chat/completions", {"messages": [*CHAT, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "Sunny."}], "max_tokens": 8, "tools": TOOLS}),
    ("developer", "chat/completions", {"messages": [*CHAT, {"role": "developer", "content": "In French."}],
                                       "max_tokens": 8}),
    ("reasoning", "chat/completions", {"messages": CHAT, "max_tokens": 12,
                                       "chat_template_kwargs": {"enable_thinking": True}}),
]
def _calls(choice: dict) -> list[dict]:
    calls = choice["tool_calls"]  # a streamed answer's merged by call index
    return list(calls.values()) if isinstance(calls, dict) else calls


SHOWS = {  # what an answer must show, besides being vllm serve's
    # "tools required" is left out: its grammar lets calls follow calls, and the tiny model's run on
    # past max_tokens (equal on both, no complete call to parse); one call ends the grammar.
    "tools named": lambda c: [call["name"] for call in _calls(c)] == ["get_weather"] and c["finish_reason"] == "stop",
    "tools one call": lambda c: len(_calls(c)) == 1 and c["finish_reason"] == "tool_calls",
    "reasoning": lambda c: c["reasoning"] and not c["text"],
    "response_format structural tag": lambda c: re.fullmatch("<n>[0-9]{1,3}</n>", c["text"]),
}
# What vllm serve gets instead, where the router serves a field vLLM 0.32 drops unread: the same meaning.
THEIRS = {"guided json": {"prompt": PROMPT, "max_tokens": 30, "structured_outputs": {"json": SMALL_SCHEMA}}}
STREAMED = ["plain", "seeded sample", "stop string", "stop token", "n=3 seeded", "chat n=2 seeded", "json schema",
            "logprobs 3", "chat", "chat logprobs", "tools auto", "tools required", "tools named", "tools one call",
            "reasoning"]


@pytest.fixture(scope="module")
def cluster():
    return shared_cluster("p1d1", p1d1_spec)


@pytest.fixture(scope="module")
def vllm_serve():
    """vLLM's OpenAI server on the tiny model, as the cluster's engines run it (cluster/reference_engine.py
    sets the same engine arguments and run-time patches), on core 0."""
    from pdcluster.cluster import vllm_patches

    model, port = tiny_model_dir(), free_port()
    # The engine core in the server's process: one interpreter less to start (~4 s here), the same outputs.
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0",
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           **vllm_patches.engine_env([*vllm_patches.patch_sets_for_device("cpu"),
                                      *vllm_patches.patch_sets_for_model(model, "cpu")])}
    parsers = ["--enable-auto-tool-choice", "--tool-call-parser", PARSERS["tool_call_parser"],
               "--reasoning-parser", PARSERS["reasoning_parser"]]
    args = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--served-model-name", MODEL,
            *parsers,
            "--dtype", "float32", "--max-model-len", "8192", "--max-num-batched-tokens", "8192", "--block-size", "128",
            "--enforce-eager", "--seed", "0", "--host", "127.0.0.1", "--port", str(port)]
    proc = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        assert proc.poll() is None, f"vllm serve exited: {proc.stderr.read()[-3000:]}"
        try:
            return httpx.get(f"{url}/v1/models", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    try:
        wait_until(up, 240, interval=0.5, what="vllm serve answering")
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def ask(url: str, endpoint: str, body: dict, stream: bool) -> tuple[dict, httpx.Response]:
    """The answer, a streamed one merged into the fields compared here; and the response."""
    full = {"model": MODEL, "temperature": 0, **body, "stream": stream}
    if stream:
        full["stream_options"] = {"include_usage": True}
    r = httpx.post(f"{url}/v1/{endpoint}", json=full, timeout=120)
    assert r.status_code == 200, r.text
    if not stream:
        return r.json(), r
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    choices: dict[int, dict] = {}
    for e in events:
        for c in e["choices"]:
            merged = choices.setdefault(c["index"], {"text": "", "tokens": [], "token_logprobs": [], "content": [],
                                                     "finish_reason": None, "stop_reason": None, "reasoning": "",
                                                     "tool_calls": {}})
            delta = c.get("delta") or {}
            merged["text"] += c.get("text") or delta.get("content") or ""
            merged["reasoning"] += delta.get("reasoning") or ""
            for call in delta.get("tool_calls") or ():  # a call's name comes once, its arguments in pieces
                got = merged["tool_calls"].setdefault(call["index"], {"name": "", "arguments": ""})
                got["name"] += (call.get("function") or {}).get("name") or ""
                got["arguments"] += (call.get("function") or {}).get("arguments") or ""
            merged["finish_reason"] = c["finish_reason"] or merged["finish_reason"]
            merged["stop_reason"] = c.get("stop_reason", "(none)") if c["finish_reason"] else merged["stop_reason"]
            lp = c.get("logprobs") or {}
            merged["tokens"] += lp.get("tokens", [])
            merged["token_logprobs"] += lp.get("token_logprobs", [])
            merged["content"] += lp.get("content") or []
    return {"usage": events[-1]["usage"], "choices": [choices[i] for i in sorted(choices)]}, r


def sdk_parses(endpoint: str, body: dict, response: httpx.Response) -> None:
    """The official openai client, handed this very response (no second request), makes its typed
    objects of it: the answer, or every chunk of the stream."""
    import openai

    transport = httpx.MockTransport(lambda request: httpx.Response(200, headers=response.headers,
                                                                   content=response.content))
    client = openai.OpenAI(base_url="http://sdk.invalid/v1", api_key="none", http_client=httpx.Client(transport=transport))
    kind = client.chat.completions if endpoint.startswith("chat") else client.completions
    sdk_body = {k: v for k, v in body.items() if k in ("prompt", "messages", "max_tokens", "stream")}
    answer = kind.create(model=MODEL, **sdk_body, extra_body={k: v for k, v in body.items() if k not in sdk_body})
    for _ in answer if body.get("stream") else ():
        pass
    assert answer is not None


def compared(answer: dict, stream: bool) -> dict:
    """The fields that must be equal: usage's counts, and each choice's text, finish, stop reason,
    token ids, logprobs and prompt logprobs (a streamed answer's merged per choice)."""
    usage = {k: answer["usage"].get(k) for k in ("prompt_tokens", "completion_tokens", "total_tokens",
                                                 "completion_tokens_details")}
    if stream:
        return {"usage": usage, "choices": answer["choices"]}
    return {"usage": usage, "prompt_logprobs": answer.get("prompt_logprobs"), "choices": [
        {"index": c["index"], "finish_reason": c["finish_reason"], "stop_reason": c["stop_reason"],
         "text": c["text"] if "text" in c else c["message"]["content"], "logprobs": c.get("logprobs"),
         "reasoning": (c.get("message") or {}).get("reasoning"),
         "tool_calls": [call["function"] for call in (c.get("message") or {}).get("tool_calls") or ()],
         "token_ids": c.get("token_ids"), "prompt_token_ids": c.get("prompt_token_ids"),
         "prompt_logprobs": c.get("prompt_logprobs")} for c in answer["choices"]]}


def numbers_apart(x, y, path="") -> list[str]:
    """Where two JSON values differ: numbers by more than 1e-3, anything else at all."""
    if isinstance(x, float | int) and isinstance(y, float | int) and not isinstance(x, bool):
        return [] if abs(x - y) <= 1e-3 else [f"{path}: {x} != {y}"]
    if isinstance(x, dict) and isinstance(y, dict):
        if list(x) != list(y):
            return [f"{path}: keys {list(x)[:8]} != {list(y)[:8]}"]
        return [d for k in x for d in numbers_apart(x[k], y[k], f"{path}.{k}")]
    if isinstance(x, list) and isinstance(y, list):
        if len(x) != len(y):
            return [f"{path}: {len(x)} items != {len(y)}"]
        return [d for i, (a, b) in enumerate(zip(x, y)) for d in numbers_apart(a, b, f"{path}[{i}]")]
    return [] if x == y else [f"{path}: {str(x)[:80]!r} != {str(y)[:80]!r}"]


@pytest.mark.parametrize("stream", [False, True])
def test_the_cluster_answers_as_vllm_serve_does(cluster, vllm_serve, stream):
    both = ThreadPoolExecutor(2)
    plain = ask(vllm_serve, "completions", {"prompt": PROMPT, "max_tokens": 12, "return_token_ids": True}, False)[0]
    third = plain["choices"][0]["token_ids"][2]
    apart = {}
    for name, endpoint, body in CORPUS:
        if stream and name not in STREAMED:
            continue
        if name == "stop token":
            body = {**body, "stop_token_ids": [third]}
        # Both at once: vllm serve and P share core 0, D has core 1; the waits overlap.
        mine = both.submit(ask, cluster.url, endpoint, body, stream)
        other = both.submit(ask, vllm_serve, endpoint, THEIRS.get(name, body), stream)
        (ours, response), (theirs, _) = mine.result(), other.result()
        if diff := numbers_apart(compared(ours, stream), compared(theirs, stream)):
            apart[name] = diff[:4]
        sdk_parses(endpoint, {**body, "stream": stream}, response)
        if name in SHOWS:  # not equal by both lacking it: the call, or the reasoning, is there
            choice = compared(ours, stream)["choices"][0]
            assert SHOWS[name](choice), (name, choice)
    assert not apart, json.dumps(apart, indent=1)


REFUSED = [  # what vllm serve answers 400, the router before dispatch or D's vLLM as the request reaches it
    {"structured_outputs": {"regex": "("}},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "strin"}}}}}},
    {"structured_outputs": {"grammar": "root ::= ("}},
    {"structured_outputs": {"choice": []}},
    {"response_format": {"type": "structural_tag", "structures": "none"}},
    {"response_format": {"type": "structural_tag", "format": {"type": "no such format"}}},
    {"n": 2, "temperature": 0},
    {"logprobs": 21},
    {"prompt_logprobs": 1, "stream": True},
]


CHAT_REFUSED = [  # the same, on chat
    {"tools": []},
    {"tool_choice": "required"},
    {"tools": TOOLS, "tool_choice": "sometimes"},
    {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
    {"tools": TOOLS, "tool_choice": {"type": "function"}},
    {"add_generation_prompt": True, "continue_final_message": True},
]


def test_what_vllm_serve_refuses_the_cluster_refuses_and_serves_on(cluster, vllm_serve):
    asks = [("completions", {"prompt": PROMPT, **body}) for body in REFUSED]
    asks += [("chat/completions", {"messages": CHAT, **body}) for body in CHAT_REFUSED]
    for endpoint, body in asks:
        full = {"model": MODEL, "max_tokens": 4, "temperature": 1.0, **body}
        theirs = httpx.post(f"{vllm_serve}/v1/{endpoint}", json=full, timeout=60)
        ours = httpx.post(f"{cluster.url}/v1/{endpoint}", json=full, timeout=60)
        assert (ours.status_code, theirs.status_code) == (400, 400), (body, ours.text, theirs.text)
        assert ours.json()["error"]["message"], body
    assert ask(cluster.url, "completions", {"prompt": PROMPT, "max_tokens": 4}, False)[0]["choices"][0]["text"]


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_a_constraint_only_ds_vllm_refuses_leaves_no_block_on_p(cluster, mode):
    """D's vLLM refuses a bad regex as the request reaches it, after P's prefill (pull) or during
    it (push): P's blocks are freed then, not after transfer.lease_s (60 s)."""
    assert cluster.spec.transfer.lease_s >= 60
    with transfer_as(cluster, mode):
        for i in range(3):
            r = httpx.post(f"{cluster.url}/v1/completions", timeout=60, json={
                "model": MODEL, "prompt": f"{i} {mode} " + PROMPT * 4, "max_tokens": 4,
                "structured_outputs": {"regex": "("}})
            assert r.status_code == 400, r.text
    assert_no_kv_in_use(cluster, timeout=10)
