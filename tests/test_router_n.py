"""n choices of one request through the router's front end (router/openai_stream.py run_job,
router/openai_api.py): each choice's text, finish and logprobs apart, usage counting every
token once, streamed chunks naming their choice; a stop string ends its own choice."""

from __future__ import annotations

import asyncio

from router_fakes import TEXT, sse_events

from pdcluster.proto.messages import SamplingSpec
from pdcluster.router.backend import GenerationChunk
from pdcluster.router.openai_models import PdUsage
from pdcluster.router.openai_stream import Job, run_job

CHAT = {"messages": [{"role": "user", "content": "hi"}]}


def test_n_choices_each_whole_and_usage_counts_them_all(fake_router, tok):
    client, backend = fake_router()
    body = client.post("/v1/completions", json={"prompt": "a", "n": 3, "logprobs": 0, "return_token_ids": True}).json()
    assert backend.calls[0][2].n == 3
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert all(c["text"] == TEXT and c["finish_reason"] == "stop" for c in body["choices"])
    n_out = len(tok.encode(TEXT)) + 1
    assert all(len(c["logprobs"]["tokens"]) == n_out == len(c["token_ids"]) for c in body["choices"])
    assert body["usage"]["completion_tokens"] == 3 * n_out

    chat = client.post("/v1/chat/completions", json={**CHAT, "n": 2}).json()
    assert [c["message"]["content"] for c in chat["choices"]] == [TEXT, TEXT]


def test_streamed_each_chunk_names_its_choice_and_each_choice_gets_its_role(fake_router):
    client, _ = fake_router()
    with client.stream("POST", "/v1/chat/completions", json={**CHAT, "n": 2, "stream": True,
                                                              "stream_options": {"include_usage": True}}) as r:
        r.read()
    events = sse_events(r)
    roles = [e["choices"][0]["index"] for e in events if e["choices"] and "role" in e["choices"][0]["delta"]]
    assert roles == [0, 1]
    for index in (0, 1):
        mine = [e["choices"][0] for e in events if e["choices"] and e["choices"][0]["index"] == index]
        assert "".join(c["delta"].get("content", "") for c in mine) == TEXT
        assert [c["finish_reason"] for c in mine if c["finish_reason"]] == ["stop"]
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] > 0


class TwoTexts:
    """A backend whose two choices say different things, interleaved, the first stopping early."""

    def __init__(self, tok):
        self.texts = [tok.encode(" alpha beta gamma delta"), tok.encode(" one two three four five six")]
        self.closed = False

    async def generate(self, request_id, prompt, sampling, arrival_ns=None, traceparent=None):
        try:
            longest = max(map(len, self.texts))
            for i in range(longest):
                for index, ids in enumerate(self.texts):
                    if i < len(ids):
                        yield GenerationChunk([ids[i]], index=index)
            yield GenerationChunk([], None, index=0, choice_finish="length")
            yield GenerationChunk([], "length", PdUsage(p_cached_tokens=0, d_cached_tokens=0, transferred_tokens=0),
                                  index=1, choice_finish="length")
        finally:
            self.closed = True


def test_a_stop_string_ends_its_own_choice_and_the_others_go_on(tok):
    backend = TwoTexts(tok)
    job = Job("r", False, "tiny", [1], SamplingSpec(max_tokens=8, n=2), stops=(" beta",), stream=False,
              include_usage=False, return_token_ids=False, arrival_ns=0)

    async def collect():
        return [d async for d in run_job(backend, tok, job)]

    deltas = asyncio.run(collect())
    text = {i: "".join(d.text for d in deltas if d.index == i) for i in (0, 1)}
    assert text == {0: " alpha", 1: " one two three four five six"}
    ends = {d.index: (d.finish_reason, d.stop_reason) for d in deltas if d.finish_reason}
    assert ends == {0: ("stop", " beta"), 1: ("length", None)}
    # the stopped choice's tokens after its stop are not its: usage counts up to the stop
    until_stop = next(k for k in range(1, len(backend.texts[0]) + 1) if " beta" in tok.decode(backend.texts[0][:k]))
    assert deltas[-1].usage.completion_tokens == until_stop + len(backend.texts[1]) and until_stop < len(backend.texts[0])
