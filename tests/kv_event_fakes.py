"""A vLLM ZmqEventPublisher in-process standing for an engine, and a feed that follows it, for
tests/test_kv_events*.py (the `ports` and `engine` fixtures are imported there)."""

from __future__ import annotations

import time

import pytest
from e2e import free_port

from pdcluster.router.kv_events import KvEventFeed
from pdcluster.router.prefix_index import chain_hashes

BS = 4
NAME = "prefill-0"


def family(n: int, blocks: int = 3) -> list[int]:
    """A prompt of `blocks` full blocks, distinct per n."""
    return [1000 * n + t for t in range(blocks * BS)]


def vllm_stored(engine_hashes, parent, tokens):
    from vllm.distributed.kv_events import BlockStored as VStored

    return VStored(block_hashes=list(engine_hashes), parent_block_hash=parent, token_ids=list(tokens),
                   block_size=BS, lora_id=None, medium="GPU", lora_name=None, group_idx=0)


def vllm_removed(engine_hashes):
    from vllm.distributed.kv_events import BlockRemoved as VRemoved

    return VRemoved(block_hashes=list(engine_hashes), medium="GPU", group_idx=0)


def publisher(endpoint: str, replay_endpoint: str, buffer_steps: int = 10_000):
    """vLLM's ZmqEventPublisher; a port its predecessor just closed may take zmq's I/O thread a
    moment to release, as when an engine restarts."""
    import zmq
    from vllm.distributed.kv_events import ZmqEventPublisher

    deadline = time.monotonic() + 5
    while True:
        try:
            return ZmqEventPublisher(0, endpoint=endpoint, replay_endpoint=replay_endpoint,
                                     buffer_steps=buffer_steps, topic="kv")
        except zmq.ZMQError as e:
            if e.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                raise
            time.sleep(0.05)


class Engine:
    """A vLLM ZmqEventPublisher on free ports, publishing as an engine's scheduler does."""

    def __init__(self, pub_port: int, replay_port: int, buffer_steps: int = 10_000):
        self.pub = publisher(f"tcp://*:{pub_port}", f"tcp://127.0.0.1:{replay_port}", buffer_steps)

    def publish(self, *events) -> None:
        from vllm.distributed.kv_events import KVEventBatch

        self.pub.publish(KVEventBatch(ts=time.time(), events=list(events)))

    def store_root(self, hash_base: int, tokens: list[int]) -> None:
        """One batch storing a prompt's blocks from the root (engine hashes hash_base, +1, ...)."""
        n = len(tokens) // BS
        self.publish(vllm_stored(range(hash_base, hash_base + n), None, tokens))

    def wait_published(self, timeout: float = 5.0) -> None:
        """Until the publisher thread has sent every batch given to it (its replay buffer holds them)."""
        deadline = time.monotonic() + timeout
        while self.pub._event_queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not self.pub._event_queue.unfinished_tasks, "the publisher did not send its batches"

    def close(self) -> None:
        self.pub.shutdown()


@pytest.fixture
def ports():
    return free_port(), free_port()


@pytest.fixture
def engine(ports):
    e = Engine(*ports)
    yield e
    e.close()


def feed_for(ports, **kw) -> KvEventFeed:
    pub, replay = ports
    return KvEventFeed({NAME: (f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}")}, BS, **{"curve": None, **kw})


def matched(feed: KvEventFeed, prompt: list[int]) -> int:
    return feed.matched_blocks(NAME, chain_hashes(prompt, BS))
