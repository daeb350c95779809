"""Unit tests of the router's text codec (router/text_codec.py): incremental detokenizing and prompt tokenizing."""

from __future__ import annotations

import asyncio
import random

import pytest

from pdcluster.router.openai_api import build_app


@pytest.mark.parametrize("seed", range(20))
def test_detokenizer_in_any_batches_gives_the_whole_decode(tok, seed):
    from pdcluster.router.text_codec import Detokenizer as _Detokenizer

    rng = random.Random(seed)
    # Random ids split UTF-8 characters across tokens, and may end inside one.
    ids = [rng.randrange(3, len(tok)) for _ in range(rng.randrange(1, 80))]
    detok, text, i = _Detokenizer(tok), "", 0
    while i < len(ids):
        n = rng.randrange(1, 5)
        text += detok.add(ids[i:i + n])
        assert not text.endswith("\ufffd"), "a split character came out before it completed"
        i += n
    # ... and one the answer ends inside never does (vLLM's server flushes none at the end)
    assert text == tok.decode(ids, skip_special_tokens=True).rstrip("\ufffd")


@pytest.mark.parametrize("seed", range(10))
def test_prompt_tokenizer_equals_the_tokenizers_encode(tok, seed):
    from pdcluster.router.text_codec import PromptTokenizer as _PromptTokenizer

    prompts = _PromptTokenizer(tok)
    rng = random.Random(seed)
    pieces = ["Hello", " world", "\n\n", "  ", "é", "你好", "\u2028", "<|endoftext|>", "<|im_start|>", "user",
              "123", "!?", "\t", tok.decode(rng.randrange(3, len(tok)))]
    text = "".join(rng.choice(pieces) for _ in range(rng.randrange(0, 40)))
    assert asyncio.run(prompts.text(text)) == tok.encode(text)
    tok.apply_chat_template([{"role": "user", "content": text}], tokenize=True)  # HF calls between ours
    assert asyncio.run(prompts.text(text)) == tok.encode(text)


def test_long_prompts_are_tokenized_off_the_event_loop(tok):
    import threading

    from pdcluster.router.text_codec import INLINE_TOKENIZE_CHARS
    from pdcluster.router.text_codec import PromptTokenizer as _PromptTokenizer

    prompts = _PromptTokenizer(tok)
    threads = []
    encode = prompts._encode
    prompts._encode = lambda text: threads.append(threading.current_thread().name) or encode(text)
    short, long = "Once upon a time", "Once upon a time, " * (INLINE_TOKENIZE_CHARS // 10)
    messages = [{"role": "user", "content": long}]

    async def main():
        return await prompts.text(short), await prompts.text(long), await prompts.chat(messages)

    got_short, got_long, got_chat = asyncio.run(main())
    assert got_short == tok.encode(short) and got_long == tok.encode(long)
    assert got_chat == list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                     return_dict=False))
    assert threads[0] == threading.current_thread().name and threads[1].startswith("tokenize")


def test_long_prompts_in_flight_together_are_tokenized_at_once(tok):
    """Two long prompts are encoded in two threads at the same time: each encode waits at a
    barrier that opens only when both are inside, so one thread at a time would time out."""
    import threading

    from pdcluster.router.text_codec import INLINE_TOKENIZE_CHARS
    from pdcluster.router.text_codec import PromptTokenizer as _PromptTokenizer

    prompts = _PromptTokenizer(tok, threads=2)
    both_inside = threading.Barrier(2, timeout=10)
    encode = prompts._encode

    def encode_when_both_inside(text: str) -> list[int]:
        both_inside.wait()
        return encode(text)

    prompts._encode = encode_when_both_inside
    texts = [f"Prompt {i}: " + "once upon a time, " * (INLINE_TOKENIZE_CHARS // 10) for i in range(2)]

    async def main():
        return await asyncio.gather(*(prompts.text(t) for t in texts))

    assert asyncio.run(main()) == [tok.encode(t) for t in texts]


def test_tokenize_stall_bench_runs(tok_dir, tok):
    import uvloop

    from pdcluster.bench.tokenize_stall import InstantBackend, burst, long_prompt, measure

    text, n_tokens = long_prompt(tok, 8000)
    assert abs(n_tokens - 8000) < 200
    app = build_app(InstantBackend(len(tok)), tok_dir)
    stall = uvloop.run(measure(app, text))
    assert stall.long_ms > 0 and stall.short_served > 0 and stall.short_p50_ms <= stall.short_max_ms
    assert uvloop.run(burst(app, [f"{i} {text}" for i in range(3)])) > 0


def test_the_tokenizers_queue_is_bounded_and_the_excess_is_a_429(tok):
    """Issue 26 item 5: the tokenizer's queue had no bound; a job past it is refused at once."""
    import threading

    from dispatch_fakes import until

    from pdcluster.router.backend import BackendError
    from pdcluster.router.text_codec import INLINE_TOKENIZE_CHARS
    from pdcluster.router.text_codec import PromptTokenizer as _PromptTokenizer

    prompts = _PromptTokenizer(tok, threads=1, queue=2)
    release = threading.Event()
    encode = prompts._encode

    def held_in_threads(text: str) -> list[int]:
        if threading.current_thread().name.startswith("tokenize"):
            assert release.wait(10)
        return encode(text)

    prompts._encode = held_in_threads
    long = "once upon a time, " * (INLINE_TOKENIZE_CHARS // 10)

    async def main():
        held = [asyncio.ensure_future(prompts.text(long)) for _ in range(2)]
        await until(lambda: prompts._queued == 2, 5, what="both handed to the thread pool")
        with pytest.raises(BackendError) as err:
            await prompts.text(long)
        assert err.value.status == 429 and "2 prompts waiting" in str(err.value)
        assert await prompts.text("short") == tok.encode("short")  # inline: never queued
        release.set()
        return await asyncio.gather(*held)

    assert asyncio.run(main()) == [tok.encode(long)] * 2


def test_chat_messages_cost_by_every_field_and_long_detokenizes_go_off_the_loop(tok):
    """A 3 MB `role`, or many empty messages, were templated on the event loop (their cost
    was counted by content alone); /detokenize decoded on it."""
    import threading

    from pdcluster.router.text_codec import INLINE_TOKENIZE_CHARS
    from pdcluster.router.text_codec import PromptTokenizer as _PromptTokenizer

    prompts = _PromptTokenizer(tok)
    seen = []
    run = prompts.run
    prompts.run = lambda chars, work: run(chars, lambda: seen.append(threading.current_thread().name) or work())
    many = [{"role": "user", "content": ""}] * (INLINE_TOKENIZE_CHARS // 32)
    ids = tok.encode("once upon a time, " * 2000)

    async def main():
        await prompts.chat(many)
        return await prompts.decode(ids, len(tok))

    assert asyncio.run(main()) == tok.decode(ids)
    assert [name.startswith("tokenize") for name in seen] == [True, True], seen


@pytest.mark.parametrize("text", ["Hello , world . It ' s ok ? Yes !", "héllo 你好 \n\t spaced   out", "a" * 5000])
def test_the_gil_free_decode_is_the_tokenizers_decode(tok, text):
    """/detokenize decodes through the Rust tokenizer's decode_batch (no GIL held): the same text
    as HF's decode, clean-up of spaces included where the tokenizer does it."""
    from pdcluster.router.text_codec import _gil_free_decode

    ids = tok.encode(text)
    assert _gil_free_decode(tok)(ids) == tok.decode(ids)


def test_a_detokenize_names_the_first_id_out_of_range(tok):
    from pdcluster.router.text_codec import PromptTokenizer as _PromptTokenizer

    with pytest.raises(ValueError, match=rf"token id {len(tok)} at index 2 is out of range \[0, {len(tok)}\)"):
        asyncio.run(_PromptTokenizer(tok).decode([1, 2, len(tok), -1], len(tok)))
