"""D samples a request's n choices (vLLM's `n`) from one prefill.

The first choice is the request as D runs any: it loads the prompt's KV from P (or prefills it).
Once vLLM gives its first output, the prompt's full blocks are in D's prefix cache; the other n-1
start then, as requests of their own without a handle, each reading those blocks and computing
only the prompt's last partial block. Each choice's seed is the request's plus its index, as
vLLM's ParentRequest seeds its children. P prefills once, whatever n.

The choices' deltas are merged into the request's one stream: each names its choice (`index`) and
the one that ends a choice says how (`choice_finish`); the last of all has `finish_reason` too,
with the first choice's transfer report and engine times (its load was the request's). A choice
that fails before its first output (P's KV did not come) ends the request with its failure.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import replace

from pdcluster.proto.messages import DecodeDelta

_END = object()  # a choice's stream ended


async def parallel_samples(n: int, choice: Callable[[int, asyncio.Event | None], AsyncIterator[DecodeDelta]]
                           ) -> AsyncIterator[DecodeDelta]:
    """`choice(index, first_output)`: that choice's deltas; the first choice's sets `first_output`
    at vLLM's first output with a token for it (its prompt is computed, or loaded, by then)."""
    queue: asyncio.Queue = asyncio.Queue()
    first_output = asyncio.Event()

    async def pump(index: int, deltas: AsyncIterator[DecodeDelta]) -> None:
        try:
            async for delta in deltas:
                queue.put_nowait((index, delta))
            queue.put_nowait((index, _END))
        except asyncio.CancelledError:
            raise
        except BaseException as err:  # noqa: BLE001 - re-raised by the merger
            queue.put_nowait((index, err))
        finally:
            await deltas.aclose()

    async def start_the_rest() -> None:
        await first_output.wait()
        for index in range(1, n):
            tasks.append(asyncio.create_task(pump(index, choice(index, None))))

    tasks = [asyncio.create_task(pump(0, choice(0, first_output))), asyncio.create_task(start_the_rest())]
    first_final: DecodeDelta | None = None  # the first choice's last delta: the request's report
    ended = 0
    try:
        while ended < n:
            index, delta = await queue.get()
            if delta is _END:
                continue
            if isinstance(delta, BaseException):
                raise delta
            if delta.finish_reason is None:
                yield replace(delta, index=index)
                continue
            ended += 1
            if index == 0:
                first_final = delta
                if delta.finish_reason in ("error", "abort") and not first_output.is_set():
                    yield delta  # no choice began: the request fails as a single one would
                    return
            if ended < n:
                yield replace(delta, index=index, choice_finish=delta.finish_reason, finish_reason=None,
                              transfer=None, engine=None)
            else:
                assert first_final is not None
                yield replace(delta, index=index, choice_finish=delta.finish_reason, transfer=first_final.transfer,
                              engine=first_final.engine, num_cached_tokens=first_final.num_cached_tokens)
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
