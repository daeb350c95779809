"""D's sampling parameters beyond the plain ones (issue 30, router/sampling_checks.py): what the
router hands the backend, how the engines' vLLM gets them (cluster/engine_actor.py), and stop
strings inside the first min_tokens tokens (router/openai_stream.py), as vLLM's server does."""

from __future__ import annotations

import pytest
from router_fakes import TEXT

from pdcluster.cluster.engine_actor import sampling_params
from pdcluster.proto.messages import SamplingSpec


def test_the_backend_gets_them_as_vllm_reads_them(fake_router, tok):
    client, backend = fake_router()
    r = client.post("/v1/completions", json={
        "prompt": "a", "frequency_penalty": 0.5, "presence_penalty": -1, "repetition_penalty": 1.2, "min_p": 0.1,
        "min_tokens": 3, "logit_bias": {"7": 250, "9": -1.5}, "allowed_token_ids": [7, 9, 11],
        "bad_words": ["hello", "hello", "world"]})
    assert r.status_code == 200, r.text
    s = backend.calls[0][2]
    assert (s.frequency_penalty, s.presence_penalty, s.repetition_penalty, s.min_p, s.min_tokens) == (0.5, -1, 1.2, 0.1, 3)
    assert s.logit_bias == ((7, 100.0), (9, -1.5))  # clamped to [-100, 100], as vLLM
    words = tuple(tuple(tok.encode(w, add_special_tokens=False)) for w in ("hello", " hello", "world", " world"))
    assert s.allowed_token_ids == (7, 9, 11) and s.bad_words_token_ids == tuple(
        w for k, w in enumerate(words) if k % 2 == 0 or (w[0] != words[k - 1][0] and len(w) == len(words[k - 1])))


def test_unset_they_are_vllms_defaults():
    plain = sampling_params(SamplingSpec(max_tokens=8))
    assert (plain.frequency_penalty, plain.presence_penalty, plain.repetition_penalty, plain.min_p,
            plain.min_tokens, plain.logit_bias, plain.allowed_token_ids, plain.bad_words_token_ids) == \
        (0, 0, 1, 0, 0, None, None, None)


def test_the_engines_vllm_gets_each_one():
    spec = SamplingSpec(max_tokens=8, frequency_penalty=0.5, presence_penalty=-1, repetition_penalty=1.2, min_p=0.1,
                        min_tokens=3, logit_bias=((7, 100.0), (9, -1.5)), allowed_token_ids=(7, 9),
                        bad_words_token_ids=((5, 6), (8,)))
    d = sampling_params(spec)
    assert (d.frequency_penalty, d.presence_penalty, d.repetition_penalty, d.min_p, d.min_tokens) == (0.5, -1, 1.2, 0.1, 3)
    assert d.logit_bias == {7: 100.0, 9: -1.5} and d.allowed_token_ids == [7, 9]
    assert d.bad_words_token_ids == [[5, 6], [8]]  # as its tokenizer would have split them
    assert sampling_params(spec, max_tokens=1).min_tokens == 1  # P's one token: min_tokens within it


@pytest.mark.parametrize("min_tokens", [0, 1, 2, 3, 8])
def test_a_stop_string_inside_the_first_min_tokens_does_not_end_the_answer(fake_router, tok, min_tokens):
    """TEXT is "Hello world, ..."; the stop string "world" ends within its first few tokens."""
    client, _ = fake_router()
    ids = tok.encode(TEXT)
    within = next(k for k in range(1, len(ids) + 1) if "world" in tok.decode(ids[:k]))  # the token that ends it
    assert 2 <= within < 8, within
    stopped = within > min_tokens  # vLLM: a stop string counts if it ends past the first min_tokens' text
    r = client.post("/v1/completions", json={"prompt": "a", "stop": ["world"], "min_tokens": min_tokens,
                                             "max_tokens": 40})
    text = r.json()["choices"][0]["text"]
    assert text == ("Hello " if stopped else TEXT), text
