"""The torch.distributed pair channel (gloo), between this process (D) and a spawned P.

No engines: P is a child process started with multiprocessing's spawn, serving a KV
service with no blocks (transfer/grpc_server.py, which hosts the channels' stores) on a
free port it reports back; this process opens D's end through it (transfer/channels.py's
ChannelPool), as a D engine's worker does.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import threading
import time

import pytest
import torch

from pdcluster.transfer import refusal_counts
from pdcluster.transfer.channel_store import ChannelStores, LocalStore
from pdcluster.transfer.channels import ChannelPool
from pdcluster.transfer.dist_blocks import count_chunks, recv_blocks, send_blocks
from pdcluster.transfer.dist_channel import ChannelError, TensorChannel, open_channel
from pdcluster.transfer.dist_liveness import channel_liveness_key
from pdcluster.transfer.grpc_auth import GrpcAuth
from pdcluster.transfer.grpc_client import kv_stub

HOST = "127.0.0.1"
SECRET = "dist-channel-test-secret-0123"
SERVER = "p-test"  # the KV service's engine id: its tokens are bound to it
KEY = channel_liveness_key(SECRET)
DTYPES = (torch.bfloat16, torch.float32, torch.uint8)
BLOCK_SHAPE = (2, 2, 16, 8)  # (K/V, kv heads, block size, head dim), the CPU layout's block
NUM_BLOCKS = 12
P_IDS = (3, 4, 5, 6, 9, 1, 0)  # runs and strays, so chunks go both zero-copy and gathered
D_IDS = (7, 8, 2, 4, 5, 10, 11)
CHUNK_BYTES = 2 * BLOCK_SHAPE[0] * BLOCK_SHAPE[1] * BLOCK_SHAPE[2] * BLOCK_SHAPE[3] * 2  # 2 bf16 blocks


def payload(dtype: torch.dtype, seed: int, n: int = 4099) -> torch.Tensor:
    """The same tensor in both processes; odd length, every bit pattern of the dtype's range."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.uint8:
        return torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8)
    return (torch.randn(n, generator=g) * 1e3).to(dtype)


def caches(seed: int | None) -> list[torch.Tensor]:
    """Two layers of a paged bf16 cache, block dim first (zeros when seed is None)."""
    if seed is None:
        return [torch.zeros(NUM_BLOCKS, *BLOCK_SHAPE, dtype=torch.bfloat16) for _ in range(2)]
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(NUM_BLOCKS, *BLOCK_SHAPE, generator=g).to(torch.bfloat16) for _ in range(2)]


# ---------------------------------------------------------------- P, in a spawned child


def kv_service(timeout_s: float):
    """A KV service with no blocks: what P's data channels need of it (OpenChannel, ChannelStore)."""
    from pdcluster.transfer.grpc_server import KvServer
    from pdcluster.transfer.paged_kv import PagedKv
    from pdcluster.transfer.sources import SourceTable

    return KvServer(SERVER, PagedKv({}, {}, 0), SourceTable({}, ()), HOST, 0, 1 << 20, secret=SECRET,
                    wait_s=timeout_s, channel_backend="gloo")


def _p_main(scenario: str, out: mp.Queue, timeout_s: float) -> None:
    try:
        server = kv_service(timeout_s)
        out.put(("port", int(server.address.rsplit(":", 1)[1])))
        host = server._channels
        deadline = time.monotonic() + 30
        while not host.opened():  # D opens the one channel of this test
            assert time.monotonic() < deadline, "D opened no channel"
            time.sleep(0.01)
        ch = host.get(host.opened()[0])
        first_tag = int(out_wait(ch, out))
        if scenario == "exchange":
            _p_exchange(ch, first_tag)
        elif scenario == "die":
            ch.send(payload(torch.float32, 0), first_tag)
            big = torch.ones(64 << 20, dtype=torch.uint8)
            ch.send_async(big, first_tag + 1)  # the second chunk is posted ...
            os._exit(3)  # ... and P dies before it is through, without closing anything
        elif scenario == "silent":
            time.sleep(timeout_s * 3)  # alive, connected, never sends
        out.put(("done", None))
        time.sleep(0.5)  # let D finish its last wait before the sockets close
        ch.close()
    except Exception as err:  # reported to the test, which fails on it
        out.put(("error", repr(err)))


def out_wait(ch: TensorChannel, out: mp.Queue) -> int:
    # D sends the request's first tag over the channel itself here; in pdcluster it comes over gRPC.
    t = torch.zeros(1, dtype=torch.int64)
    ch.recv_into(t, 0)
    return int(t)


def _p_exchange(ch: TensorChannel, first_tag: int) -> None:
    # Two threads, each posting its dtypes under its own tags in the reverse of D's receive order.
    def sender(k: int) -> None:
        posted = [ch.send_async(payload(dtype, seed=10 * k + j), first_tag + 10 * k + j)
                  for j, dtype in reversed(list(enumerate(DTYPES)))]
        for pending in posted:
            pending.wait()

    threads = [threading.Thread(target=sender, args=(k,)) for k in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    src = caches(seed=7)
    send_blocks(ch, [(v, P_IDS) for v in src], first_tag + 100, CHUNK_BYTES, window=3)


# ---------------------------------------------------------------- D, here


class PeerP:
    def __init__(self, scenario: str, timeout_s: float):
        ctx = mp.get_context("spawn")
        self.out = ctx.Queue()
        self.proc = ctx.Process(target=_p_main, args=(scenario, self.out, timeout_s), daemon=True)
        self.proc.start()
        kind, self.port = self.out.get(timeout=60)
        assert kind == "port", self.port

    def result(self, timeout: float = 10.0):
        return self.out.get(timeout=timeout)

    def stop(self) -> None:
        self.proc.join(timeout=10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()


@pytest.fixture
def peer():
    started: list[PeerP] = []

    def start(scenario: str, timeout_s: float) -> tuple[PeerP, TensorChannel, int]:
        p = PeerP(scenario, timeout_s)
        started.append(p)
        address = f"{HOST}:{p.port}"
        _, stub = kv_stub(address, GrpcAuth(SECRET), SERVER)
        ch = ChannelPool("d-test", timeout_s, KEY).get(address, stub)
        first = ch.allocate_tags(200)
        ch.send(torch.tensor([first], dtype=torch.int64), 0)
        return p, ch, first

    yield start
    for p in started:
        p.stop()


def test_exchange_dtypes_tags_two_threads_and_paged_blocks(peer):
    p, ch, first = peer("exchange", timeout_s=10.0)
    got: dict[int, torch.Tensor] = {}
    errors: list[BaseException] = []

    def receiver(k: int) -> None:
        try:
            for j, dtype in enumerate(DTYPES):
                t = torch.empty(4099, dtype=dtype)
                ch.recv_into(t, first + 10 * k + j)
                got[10 * k + j] = t
        except BaseException as err:  # noqa: BLE001 - surfaced below
            errors.append(err)

    threads = [threading.Thread(target=receiver, args=(k,)) for k in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=15)
    assert not errors, errors
    for k in (1, 2):
        for j, dtype in enumerate(DTYPES):
            assert got[10 * k + j].dtype == dtype
            assert torch.equal(got[10 * k + j].view(torch.uint8), payload(dtype, 10 * k + j).view(torch.uint8))

    dst = caches(seed=None)
    layers = [(v, D_IDS) for v in dst]
    assert count_chunks(layers, CHUNK_BYTES) == 8  # 7 blocks in runs of 2 per layer: 4 + 4
    recv_blocks(ch, layers, first + 100, CHUNK_BYTES, window=3)
    src = caches(seed=7)
    for s, d in zip(src, dst):
        for pb, db in zip(P_IDS, D_IDS):
            assert torch.equal(d[db].view(torch.int16), s[pb].view(torch.int16))
        untouched = sorted(set(range(NUM_BLOCKS)) - set(D_IDS))
        assert not d[untouched].any()
    assert p.result() == ("done", None)
    ch.close()


def test_peer_dies_mid_transfer_fails_within_timeout(peer):
    timeout_s = 5.0
    p, ch, first = peer("die", timeout_s=timeout_s)
    t = torch.empty(4099, dtype=torch.float32)
    ch.recv_into(t, first)
    assert torch.equal(t, payload(torch.float32, 0))
    # P is gone with its second send posted and not through. (D used to post its receive
    # first: once in CI, P's sending thread got all 64 MB out before P's _exit.)
    p.proc.join(timeout=10)
    assert p.proc.exitcode == 3
    big = torch.zeros(64 << 20, dtype=torch.uint8)
    t0 = time.monotonic()
    with pytest.raises(ChannelError) as info:
        ch.recv_into(big, first + 1)
    elapsed = time.monotonic() - t0
    assert elapsed < 1.0, f"took {elapsed:.2f} s: the death was not noticed before the {timeout_s} s timeout"
    # Either our liveness connection or gloo's own socket noticed first.
    assert f"recv of tag {first + 1} (67108864 B) from P (rank 0)" in str(info.value)
    # The channel is broken from now on: later operations fail at once, naming the first failure.
    t0 = time.monotonic()
    with pytest.raises(ChannelError, match="broken channel"):
        ch.recv_into(t, first + 2)
    assert time.monotonic() - t0 < 0.5
    ch.close()


def test_silent_peer_times_out_naming_the_tag(peer):
    timeout_s = 1.0
    p, ch, first = peer("silent", timeout_s=timeout_s)
    t0 = time.monotonic()
    with pytest.raises(ChannelError, match=rf"recv of tag {first + 5} \(64 B\) from P \(rank 0\)"):
        ch.recv_into(torch.empty(16), first + 5)
    assert timeout_s * 0.9 < time.monotonic() - t0 < timeout_s + 1.0
    ch.close()
    p.proc.kill()


def test_close_abandons_a_pending_wait(peer):
    p, ch, first = peer("silent", timeout_s=10.0)
    pending = ch.recv_async(torch.empty(16), first + 1)
    threading.Timer(0.2, ch.close).start()
    t0 = time.monotonic()
    with pytest.raises(ChannelError, match="abandoned: the channel was closed"):
        pending.wait()
    assert time.monotonic() - t0 < 1.0
    with pytest.raises(ChannelError, match="after close"):
        ch.recv_into(torch.empty(16), first + 2)
    p.proc.kill()


def test_a_wait_gives_up_at_its_transfers_deadline(peer):
    """A transfer's deadline sooner than the channel's timeout bounds each of its waits."""
    p, ch, first = peer("silent", timeout_s=10.0)
    pending = ch.recv_async(torch.empty(16), first + 1)
    t0 = time.monotonic()
    with pytest.raises(ChannelError, match=rf"recv of tag {first + 1} .* timed out after 0\.\d s"):
        pending.wait(until=t0 + 0.3)
    assert time.monotonic() - t0 < 2.0 and "timed out" in ch.unusable
    ch.close()
    p.proc.kill()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def test_open_against_absent_p_fails_within_timeout():
    address = f"{HOST}:{_free_port()}"
    _, stub = kv_stub(address, GrpcAuth(SECRET), SERVER)
    t0 = time.monotonic()
    with pytest.raises(ChannelError, match=f"P at {address} did not open channel .*UNAVAILABLE"):
        ChannelPool("d-test", 1.0, KEY).get(address, stub)
    assert time.monotonic() - t0 < 2.0


def local_store(name: str, timeout_s: float, stores: ChannelStores | None = None) -> LocalStore:
    stores = stores or ChannelStores()
    stores.create(name)
    return LocalStore(stores, name, timeout_s)


def test_open_without_d_fails_within_timeout():
    t0 = time.monotonic()
    with pytest.raises(ChannelError, match="D never joined within 1.0 s"):
        open_channel("p", local_store("absent-d", 1.0), "gloo", 1.0, "absent-d", HOST, KEY)
    assert time.monotonic() - t0 < 2.0


def test_the_liveness_socket_refuses_a_peer_without_the_secret_then_takes_d(caplog):
    """P's liveness listener (after the gloo rendezvous) is reached first by an intruder: P
    drops it and still pairs with D. In one process: both ends share one ChannelStores."""
    stores = ChannelStores()
    name = "intruded"
    refused = threading.Event()

    class GatedStore(LocalStore):
        def _get(self, key: str, wait_s: float):
            value = super()._get(key, wait_s)
            if key.startswith("pdc-channel-alive/"):  # D waits until the intruder was turned away
                host, port = value.decode().rsplit(":", 1)
                with socket.create_connection((host, int(port)), timeout=5) as intruder:
                    intruder.recv(20)  # P's hello
                    intruder.sendall(b"\x80\x05" + b"\0" * 50)  # a pickle, not a proof
                    assert intruder.recv(1) == b"", "P kept the intruder's connection"
                refused.set()
            return value

    stores.create(name)
    before = refusal_counts.read().channel_liveness
    ends: dict[str, TensorChannel] = {}
    p = threading.Thread(target=lambda: ends.setdefault("p", open_channel(
        "p", LocalStore(stores, name, 10.0), "gloo", 10.0, name, HOST, KEY)))
    p.start()
    ends["d"] = open_channel("d", GatedStore(stores, name, 10.0), "gloo", 10.0, name, HOST, KEY)
    p.join(10)
    assert refused.is_set() and "channel liveness socket: refused" in caplog.text
    assert refusal_counts.read().channel_liveness - before == 1
    t = torch.arange(8, dtype=torch.float32)
    got = torch.zeros(8)
    pending = ends["d"].recv_async(got, 1 << 30)
    ends["p"].send(t, 1 << 30)
    pending.wait()
    assert torch.equal(got, t)
    for ch in ends.values():
        ch.close()


def test_a_silent_peer_on_the_liveness_listener_does_not_hold_up_d():
    """Issue 26 item 6: one connection that never sent its proof took the whole open deadline,
    and the rendezvous failed. Now D, arriving after it, pairs at once."""
    from pdcluster.transfer.dist_liveness import _liveness_pair

    store = torch.distributed.HashStore()
    deadline = time.monotonic() + 4.0
    got: dict = {}
    p = threading.Thread(target=lambda: got.setdefault("p", _liveness_pair(0, store, "k", HOST, deadline, KEY)))
    p.start()
    host, port = store.get("k").decode().rsplit(":", 1)
    silent = [socket.create_connection((host, int(port)), timeout=5) for _ in range(3)]  # never prove anything
    d = _liveness_pair(1, store, "k", HOST, deadline, KEY)
    p.join(5)
    assert "p" in got, "P never took D's connection"
    d.sendall(b"x")
    assert got["p"].recv(1) == b"x"  # the pair is D's connection, not a silent one
    for s in (d, got["p"], *silent):
        s.close()


def test_tags_come_from_each_ranks_own_space_and_never_overlap():
    ch = TensorChannel(None, 1, "gloo", 1.0, "t", None)
    a, b = ch.allocate_tags(10), ch.allocate_tags(5)
    assert (a, b) == ((1 << 30), (1 << 30) + 10)
    ch._tags = iter([(1 << 30) - 3])  # near the end of the space: wraps to its start
    assert ch.allocate_tags(5) == 1 << 30
    assert TensorChannel(None, 0, "gloo", 1.0, "t", None).allocate_tags(3) == 0


def test_every_device_has_a_channel_backend():
    from pdcluster.proto.devices import DEVICES
    from pdcluster.transfer.dist_channel import BACKENDS

    assert {d.collective_backend for d in DEVICES.values()} <= set(BACKENDS)


def test_bad_arguments():
    with pytest.raises(ValueError, match="role"):
        open_channel("x", local_store("x", 1.0), "gloo", 1.0, "x", HOST, KEY)
    with pytest.raises(ValueError, match="backend"):
        open_channel("d", local_store("y", 1.0), "mpi", 1.0, "y", HOST, KEY)
