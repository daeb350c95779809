"""Text to token ids and back, for the OpenAI front end (router/openai_api.py): prompts
tokenized off the event loop when long, generated ids detokenized incrementally."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

from tokenizers.decoders import DecodeStream

from pdcluster.router.backend import BackendError


class Detokenizer:
    """Text for generated ids as they come, a step per id (tokenizers' DecodeStream, as
    vLLM v1's FastIncrementalDetokenizer): re-decoding every id so far for each delta cost
    O(n) a delta, 96 ms of router CPU for a 1,024-token answer sent a token at a time.

    A UTF-8 character split across tokens comes out with the token that completes it; ids
    that never complete one (the answer ended inside it) never come out, as in vLLM's server
    (its detokenizer flushes nothing at the end; tests/test_e2e_vllm_serve.py compares).
    """

    def __init__(self, tokenizer: Any):
        self._tokenizer = tokenizer
        self._backend = tokenizer.backend_tokenizer  # the Rust tokenizer the stream steps
        self._stream = DecodeStream(skip_special_tokens=True)

    def add(self, ids: list[int]) -> str:
        return "".join(piece for token_id in ids if (piece := self._step(token_id)) is not None)

    def _step(self, token_id: int) -> str | None:
        try:
            return self._stream.step(self._backend, token_id)
        except Exception as err:
            # tokenizers can fail a step when a decode is not an extension of the previous
            # one (vLLM issue 17448); vLLM starts a new stream then, and so do we.
            if "Invalid prefix" not in str(err):
                raise
        self._stream = DecodeStream(skip_special_tokens=True)
        return self._stream.step(self._backend, token_id)


INLINE_TOKENIZE_CHARS = 8192  # longer prompts are tokenized in worker threads (~2K tokens: ~2 ms here)
MESSAGE_CHARS = 64  # what one chat message costs the template beyond its text, in characters' worth
# One 128K-token prompt is ~0.3 s of one core: at C90's 6 req/s one thread would be ~2/3 busy,
# and a burst would queue behind it. Threads run their encodes in parallel (no GIL held).
TOKENIZE_THREADS = max(1, min(4, os.cpu_count() or 1))


class PromptTokenizer:
    """Prompts to token ids, off the event loop when they are long.

    A 128K-token text prompt takes the Rust tokenizer ~300 ms here; on the event loop,
    every other request (streams included) would wait that long. Long prompts go to a few
    worker threads instead, where `encode_batch_fast` runs without the GIL (a single `encode`
    holds it), so several long prompts are tokenized on several cores at once, as vLLM's
    API server tokenizes in a thread pool. Short ones stay inline: a thread handoff costs
    more than their encode.

    Both paths call the Rust tokenizer directly (HF's wrapper took ~9 of ~20 us a short
    prompt) with special tokens added, as `tokenizer.encode` does. One HF encode at start
    leaves truncation, padding and special-token splitting as HF's calls set them, so no
    later HF call changes the Rust tokenizer while the worker reads it (tokenizers fails
    such a call with "Already borrowed").
    """

    def __init__(self, tokenizer: Any, threads: int | None = None, queue: int | None = None):
        tokenizer.encode("")
        self._tokenizer, self._backend = tokenizer, tokenizer.backend_tokenizer
        self._decode_whole = _gil_free_decode(tokenizer)
        threads = threads or TOKENIZE_THREADS
        self._workers = ThreadPoolExecutor(threads, thread_name_prefix="tokenize")
        # Jobs waiting for or in the threads at most; more are refused with a 429 at once rather
        # than queued for seconds (under overload the router's admission refuses before this fills).
        self._queue_max = queue or 16 * threads
        self._queued = 0  # jobs handed to the threads and not done

    async def text(self, text: str) -> list[int]:
        return await self.run(len(text), partial(self._encode, text))

    async def chat(self, messages: list[dict[str, Any]], kwargs: dict[str, Any] | None = None) -> list[int]:
        """`messages`: as the template takes them (content a string, or text parts: router/chat_content.py);
        `kwargs`: the template's arguments (router/chat_template.py; default: a generation prompt)."""
        kwargs = {"add_generation_prompt": True} if kwargs is None else kwargs
        # The template's work grows with every field and every message, not the contents alone.
        cost = sum(len(m["role"]) + MESSAGE_CHARS + (len(c) if isinstance(c := m["content"], str) else
                                                     sum(len(p["text"]) + MESSAGE_CHARS for p in c)) for m in messages)
        return list(await self.run(cost, partial(self._tokenizer.apply_chat_template, messages,
                                                 tokenize=True, return_dict=False, **kwargs)))

    async def decode(self, ids: list[int], vocab_size: int) -> str:
        """The tokenizer's decode of `ids`; ValueError naming the first id outside [0, vocab_size)."""
        return await self.run(4 * len(ids), partial(self._checked_decode, ids, vocab_size))

    def _checked_decode(self, ids: list[int], vocab_size: int) -> str:
        if bad := next(((i, t) for i, t in enumerate(ids) if not 0 <= t < vocab_size), None):
            raise ValueError(f"token id {bad[1]} at index {bad[0]} is out of range [0, {vocab_size})")
        return self._decode_whole(ids)

    async def run(self, chars: int, work: Callable[[], Any]) -> Any:
        """`work` (as costly as tokenizing `chars` characters) inline if cheap, else in a thread;
        BackendError 429 if the threads' queue is full already."""
        if chars <= INLINE_TOKENIZE_CHARS:
            return work()
        if self._queued >= self._queue_max:
            raise BackendError(f"the router's tokenizer has {self._queued} prompts waiting: retry shortly", 429,
                               "rate_limit_exceeded", retry_after_s=1)
        self._queued += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._workers, work)
        finally:
            self._queued -= 1

    def _encode(self, text: str) -> list[int]:
        # encode_batch_fast: the same ids without offsets, faster; and the Encoding it drops when
        # done is small: encode_batch's is freed holding the GIL, a stall of the event loop
        # (bench/README.md "A long text prompt"; tests/test_router_loop_pace.py).
        return self._backend.encode_batch_fast([text])[0].ids


def _gil_free_decode(tokenizer: Any) -> Callable[[list[int]], str]:
    """`tokenizer.decode`, the same text, but through the Rust tokenizer's `decode_batch`, which runs
    without the GIL (HF's `decode` calls the Rust `decode`, which holds it: 0.7 s for 1M ids here,
    the router's event loop stalled meanwhile). HF may clean up spaces after the Rust decode: a
    probe finds whether this tokenizer's does, and a tokenizer whose decode differs some other way
    keeps HF's."""
    backend = tokenizer.backend_tokenizer
    probe = tokenizer.encode("Hello , world . It ' s a test ? Yes ! n't 2 + 2", add_special_tokens=False)
    raw, whole = backend.decode_batch([probe], skip_special_tokens=False)[0], tokenizer.decode(probe)

    def raw_decode(ids: list[int]) -> str:
        return backend.decode_batch([ids], skip_special_tokens=False)[0]

    if raw == whole:
        return raw_decode
    if tokenizer.clean_up_tokenization(raw) == whole:
        return lambda ids: tokenizer.clean_up_tokenization(raw_decode(ids))
    return tokenizer.decode
