"""Logprobs through the router's front end: the checks, and the shapes held to vLLM's own server's
formatting functions (called on the same positions, with the token strings vLLM's output
processor would have set), streamed and not."""

from __future__ import annotations

import functools
import json
import types

import pytest
from router_fakes import TEXT, bad_request, fake_logprobs, sse_events

from pdcluster.router.logprobs import TokenTexts

CHAT = {"messages": [{"role": "user", "content": "hi"}]}


@functools.cache
def vllm_formatters():
    """vLLM's completion and chat logprob writers, bound to a stand-in `self` (they read only
    return_tokens_as_token_ids and the static _get_decoded_token)."""
    from vllm.entrypoints.generate.base.serving import GenerateBaseServing
    from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
    from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion

    me = types.SimpleNamespace(return_tokens_as_token_ids=False,
                               _get_decoded_token=GenerateBaseServing._get_decoded_token)
    me._get_top_logprobs = functools.partial(OpenAIServingChat._get_top_logprobs, me)
    return (functools.partial(OpenAIServingCompletion._create_completion_logprobs, me),
            functools.partial(OpenAIServingChat._create_chat_logprobs, me))


def vllm_positions(tok, token_ids, top):
    """What vllm serve's engine hands its server: per position a dict of Logprob, decoded by its
    own LogprobsProcessor (a split UTF-8 character completed from the tokens before it)."""
    import numpy as np
    from vllm.v1.engine.logprobs import LogprobsProcessor

    proc = LogprobsProcessor(tok, [], None, 0.0, top, None)
    for t in token_ids:
        p = fake_logprobs(t, top)
        proc._update_sample_logprobs((np.array([p.token_ids]), np.array([p.logprobs]), np.array([p.ranks[0]]), None))
    return proc.logprobs


def test_token_texts_are_vllms(tok):
    from vllm.tokenizers.detokenizer_utils import convert_ids_list_to_tokens

    ids = list(range(len(tok)))
    texts = TokenTexts(tok)
    assert [texts(i) for i in ids] == convert_ids_list_to_tokens(tok, ids)


@pytest.mark.parametrize("top", [0, 1, 3, 20])
def test_completion_logprobs_are_vllms(fake_router, tok, top):
    client, backend = fake_router()
    body = client.post("/v1/completions", json={"prompt": "a", "logprobs": top}).json()

    generated = tok.encode(TEXT) + [tok.eos_token_id]
    completion, _ = vllm_formatters()
    want = completion(generated, vllm_positions(tok, generated, top), top, tok).model_dump()
    assert body["choices"][0]["logprobs"] == want
    assert backend.calls[0][2].logprobs == top
    assert -9999.0 in want["top_logprobs"][0].values() if top else True  # -inf is written as vLLM writes it


@pytest.mark.parametrize("top", [0, 2, 20])
def test_chat_logprobs_are_vllms(fake_router, tok, top):
    client, backend = fake_router()
    body = client.post("/v1/chat/completions", json={**CHAT, "logprobs": True, "top_logprobs": top}).json()

    generated = tok.encode(TEXT) + [tok.eos_token_id]
    _, chat = vllm_formatters()
    want = chat(generated, vllm_positions(tok, generated, top), tok, top).model_dump()
    assert body["choices"][0]["logprobs"] == want
    assert len(want["content"][0]["top_logprobs"]) == top


def test_streamed_chunks_carry_their_tokens_logprobs_as_the_whole_answer_has_them(fake_router):
    client, _ = fake_router()
    for path, body, read in [
        ("/v1/completions", {"prompt": "a", "logprobs": 2}, lambda lp: lp["tokens"]),
        ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 1}, lambda lp: lp["content"]),
    ]:
        whole = read(client.post(path, json=body).json()["choices"][0]["logprobs"])
        with client.stream("POST", path, json={**body, "stream": True}) as r:
            r.read()
        chunks = [e["choices"][0]["logprobs"] for e in sse_events(r) if e["choices"]]
        if "messages" in body:
            assert chunks[0] is None  # the role's chunk
            chunks = chunks[1:]
        # each chunk's split UTF-8 characters completed by the tokens of the chunks before it
        assert [t for c in chunks for t in read(c)] == whole and len(chunks) == len(whole)


def test_without_logprobs_none_are_asked_or_written(fake_router):
    client, backend = fake_router()
    assert client.post("/v1/completions", json={"prompt": "a"}).json()["choices"][0]["logprobs"] is None
    # vLLM's default top_logprobs 0 with logprobs off: nothing asked
    assert client.post("/v1/chat/completions", json={**CHAT, "top_logprobs": 0}).json()["choices"][0]["logprobs"] is None
    assert [c[2].logprobs for c in backend.calls] == [None, None]


@pytest.mark.parametrize("body, message", [
    ({"top_logprobs": 2}, "when using `top_logprobs`, `logprobs` must be set to true."),
    ({"logprobs": True, "top_logprobs": -3}, "`top_logprobs` must be a positive value or -1."),
    ({"logprobs": True, "top_logprobs": 21}, "Requested sample logprobs of 21, which is greater than max allowed: 20"),
    ({"logprobs": True, "top_logprobs": "2"}, "invalid 'top_logprobs'"),
])
def test_chat_logprobs_refused_as_vllm_refuses_them(fake_router, body, message):
    client, backend = fake_router()
    err = bad_request(client, "/v1/chat/completions", {**CHAT, **body})
    assert err["param"] == "top_logprobs" and message in err["message"]
    assert backend.calls == []


def test_an_engine_without_logits_refuses_logprobs(fake_router):
    client, backend = fake_router()
    backend.card = types.SimpleNamespace(**{**vars(backend.card), "logits": False})
    err = bad_request(client, "/v1/completions", {"prompt": "a", "logprobs": 0})
    assert err["param"] == "logprobs" and "the simulated engine computes no logits" in err["message"]


def vllm_prompt_positions(tok, prompt, top):
    """The prompt's, as vLLM's LogprobsProcessor writes them: each position decoded in the context
    of the prompt tokens before it (the first, None, aside)."""
    from vllm.entrypoints.generate.base.serving import clamp_prompt_logprobs
    from vllm.logprobs import Logprob
    from vllm.tokenizers.detokenizer_utils import convert_ids_list_to_tokens
    from vllm.v1.engine.logprobs import LogprobsProcessor

    proc = LogprobsProcessor(tok, None, [None], None, None, top)
    for t in prompt[1:]:
        p = fake_logprobs(t, top)
        texts = proc._verify_tokens(convert_ids_list_to_tokens(tok, list(p.token_ids)), list(p.token_ids),
                                    proc._get_sampled_context_ids(proc.prompt_logprobs))
        proc.prompt_logprobs.append({i: Logprob(lp, r, s) for i, lp, r, s in zip(p.token_ids, p.logprobs, p.ranks, texts)})
    return clamp_prompt_logprobs(proc.prompt_logprobs)


@pytest.mark.parametrize("top", [0, 5])
def test_prompt_logprobs_are_vllms_in_the_choice_and_chats_body(fake_router, tok, top):
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionResponse
    from vllm.entrypoints.openai.completion.protocol import CompletionResponseChoice

    client, backend = fake_router()
    body = client.post("/v1/completions", json={"prompt": "a b c", "prompt_logprobs": top}).json()
    prompt = backend.calls[0][1]
    assert backend.calls[0][2].prompt_logprobs == top
    want = CompletionResponseChoice(index=0, text="", prompt_logprobs=vllm_prompt_positions(tok, prompt, top))
    assert body["choices"][0]["prompt_logprobs"] == json.loads(want.model_dump_json())["prompt_logprobs"]
    assert body["choices"][0]["logprobs"] is None

    body = client.post("/v1/chat/completions", json={**CHAT, "prompt_logprobs": top}).json()
    prompt = backend.calls[1][1]
    want = ChatCompletionResponse(model="tiny", choices=[], usage={"prompt_tokens": 0, "total_tokens": 0},
                                  prompt_logprobs=vllm_prompt_positions(tok, prompt, top))
    assert body["prompt_logprobs"] == json.loads(want.model_dump_json())["prompt_logprobs"] and "prompt_logprobs" not in body["choices"][0]


def test_echo_puts_the_prompt_before_the_answer_and_its_logprobs_before_the_answers(fake_router, tok):
    client, backend = fake_router()
    body = client.post("/v1/completions", json={"prompt": "a b c", "echo": True}).json()
    assert body["choices"][0]["text"] == "a b c" + TEXT and backend.calls[0][2].prompt_logprobs is None

    body = client.post("/v1/completions", json={"prompt": "a b c", "echo": True, "logprobs": 2}).json()
    prompt, spec = backend.calls[1][1], backend.calls[1][2]
    assert (spec.logprobs, spec.prompt_logprobs) == (2, 2)  # vLLM's: the echoed prompt's as the answer's
    generated = tok.encode(TEXT) + [tok.eos_token_id]
    completion, _ = vllm_formatters()
    want = completion([*prompt, *generated], [*vllm_prompt_positions(tok, prompt, 2), *vllm_positions(tok, generated, 2)],
                      2, tok).model_dump()
    assert body["choices"][0]["logprobs"] == want and want["tokens"][0] == tok.decode(prompt[0])

    with client.stream("POST", "/v1/completions", json={"prompt": "a b c", "echo": True, "stream": True}) as r:
        r.read()
    assert "".join(e["choices"][0]["text"] for e in sse_events(r) if e["choices"]) == "a b c" + TEXT


@pytest.mark.parametrize("body, param, message", [
    ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs", "`prompt_logprobs` are not available when `stream=True`."),
    ({"prompt_logprobs": -2}, "prompt_logprobs", "`prompt_logprobs` must be a positive value or -1."),
    ({"prompt_logprobs": 21}, "prompt_logprobs", "Requested prompt logprobs of 21, which is greater than max allowed: 20"),
    ({"echo": True, "logprobs": 1, "stream": True}, "echo", "echo with logprobs is served unstreamed only"),
])
def test_prompt_logprobs_refused_as_vllm_refuses_them(fake_router, body, param, message):
    client, backend = fake_router()
    err = bad_request(client, "/v1/completions", {"prompt": "a", **body})
    assert err["param"] == param and message in err["message"]
    assert backend.calls == []


def test_prompt_logprobs_zero_streamed_is_served_as_vllm_serves_it(fake_router):
    client, backend = fake_router()  # vLLM takes it, and its stream's chunks have no place for them
    with client.stream("POST", "/v1/completions", json={"prompt": "a", "prompt_logprobs": 0, "stream": True}) as r:
        r.read()
    assert r.status_code == 200 and backend.calls[0][2].prompt_logprobs == 0


def test_a_stop_string_keeps_the_prompts_logprobs_which_come_with_the_last_chunk(fake_router):
    client, backend = fake_router()  # the fake sends them on its last chunk, after the stop string's
    body = client.post("/v1/completions", json={"prompt": "a b c", "prompt_logprobs": 0, "stop": ["world"]}).json()
    [choice] = body["choices"]
    assert (choice["text"], choice["stop_reason"]) == ("Hello ", "world")
    assert len(choice["prompt_logprobs"]) == len(backend.calls[0][1]) and choice["prompt_logprobs"][0] is None
    assert backend.closed_early == []  # read to its end for them
