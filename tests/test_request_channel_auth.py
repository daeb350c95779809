"""The request channel (transfer/request_channel.py) against peers without the cluster secret:
refused, nothing unpickled, silent ones dropped, and a router that refuses such an engine."""

from __future__ import annotations

import asyncio

import pytest
from channel_fakes import SAMPLING, SECRET, Body, LocalActor, connected, prefill_req
from e2e import evil_pickle

from pdcluster.transfer import refusal_counts
from pdcluster.transfer.request_channel import (
    EngineChannel,
    EngineUnavailable,
)

# ---- peers without the cluster secret


async def refused_after(host: str, port: int, payload: bytes, timeout: float = 5.0) -> bytes:
    """Connect, read the server's hello, send `payload`; returns the hello once the server closed."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        hello = await asyncio.wait_for(reader.readexactly(20), timeout)
        writer.write(payload)
        assert await asyncio.wait_for(reader.read(), timeout) == b"", "the server answered instead of closing"
        return hello
    finally:
        writer.close()


def test_peers_without_the_secret_are_refused_and_nothing_is_unpickled(tmp_path, caplog):
    import pickle

    from pdcluster.transfer.auth import ClientHandshake
    from pdcluster.transfer.channel_wire import channel_key
    from pdcluster.transfer.session import FrameSeal

    marker = tmp_path / "ran"
    pickle.loads(evil_pickle(marker))  # the payload is real: unpickled, it runs
    assert marker.read_text() == "unpickled"
    marker.unlink()

    async def main():
        actor, ch = await connected(Body())
        host, port = ch.address.rsplit(":", 1)
        with pytest.raises(EngineUnavailable, match="cannot connect to decode-0's request channel"):
            await EngineChannel("decode-0", actor, "another-cluster's-secret").connect()
        for payload in (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", evil_pickle(marker)):
            await refused_after(host, int(port), payload)
        # A peer that proves the secret and then sends a pickled frame, sealed: not decoded as one.
        reader, writer = await asyncio.open_connection(host, int(port))
        hs = ClientHandshake(channel_key(SECRET))
        writer.write(hs.feed(await reader.readexactly(20)).send)
        step = hs.feed(await reader.readexactly(32))
        assert step.done
        frame = FrameSeal(step.session.send).seal(evil_pickle(marker))
        writer.write(len(frame).to_bytes(4, "big") + frame)
        assert await asyncio.wait_for(reader.read(), 5) == b"", "the engine kept a connection that sent pickle"
        writer.close()
        after = await asyncio.wait_for(ch.call("prefill", prefill_req("after")).next(), 5)  # still serving
        server = actor.body._channel
        ch.close()
        return after, server.refused, actor.body.prefills

    before = refusal_counts.read().request_channel
    after, refused, prefills = asyncio.run(main())
    assert after.request_id == "after" and prefills == 1
    assert refused == 3  # the wrong secret, the garbage, the pickle sent as a handshake
    assert refusal_counts.read().request_channel - before == 3  # what /metrics shows
    assert not marker.exists()
    # One line for the three (rate-limited: a flood costs no line per attempt).
    assert caplog.text.count("request channel of Body: refused") == 1 and "a frame does not decode" in caplog.text


def test_a_silent_peer_is_dropped_after_the_handshake_timeout(monkeypatch):
    from pdcluster.transfer import channel_wire

    monkeypatch.setattr(channel_wire, "HANDSHAKE_TIMEOUT_S", 0.2)

    async def main():
        actor, ch = await connected(Body())
        host, port = ch.address.rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        await reader.readexactly(20)
        closed = await asyncio.wait_for(reader.read(), 5) == b""
        writer.close()
        refused = actor.body._channel.refused
        ch.close()
        return closed, refused

    assert asyncio.run(main()) == (True, 1)


def test_many_silent_peers_on_one_host_delay_no_router_on_another(caplog):
    """40 peers from 127.0.0.2 connect and say nothing: past MAX_PENDING_PER_HOST they are closed at
    once (no socket held for the handshake's 5 s), and a router from 127.0.0.1 connects and calls
    as usual meanwhile; the refusals make one log line."""
    from pdcluster.transfer.channel_server import ChannelServer

    async def main():
        actor, ch = await connected(Body())
        host, port = ch.address.rsplit(":", 1)
        silent = [await asyncio.open_connection(host, int(port), local_addr=("127.0.0.2", 0)) for _ in range(40)]
        outcomes = await asyncio.gather(*(asyncio.wait_for(r.read(), 0.5) for r, _ in silent), return_exceptions=True)
        closed_at_once = sum(isinstance(o, bytes) and o == b"" for o in outcomes)
        waiting = sum(isinstance(o, TimeoutError) for o in outcomes)
        # The router (127.0.0.1) opens a second connection and calls through it while they wait.
        second = await asyncio.wait_for(EngineChannel("decode-0", actor, SECRET).connect(), 2)
        result = await asyncio.wait_for(second.call("prefill", prefill_req("meanwhile")).next(), 2)
        for _, w in silent:
            w.close()
        second.close()
        ch.close()
        return closed_at_once, waiting, result.request_id

    closed_at_once, waiting, rid = asyncio.run(main())
    assert waiting == ChannelServer.MAX_PENDING_PER_HOST and closed_at_once == 40 - waiting
    assert rid == "meanwhile"
    assert caplog.text.count("request channel of Body: refused") == 1
    assert f"{ChannelServer.MAX_PENDING_PER_HOST} handshakes pending from 127.0.0.2 already" in caplog.text


def test_a_router_refuses_an_engine_without_the_secret():
    from pdcluster.transfer.auth import ServerHandshake, derive

    async def main():
        async def impostor(reader, writer):  # answers the router's proof with a MAC of another key
            hs = ServerHandshake(derive("not-this-cluster-secret", "request-channel"))
            writer.write(hs.hello())
            await reader.readexactly(52)
            writer.write(b"\0" * 32)
            await asyncio.sleep(1)
            writer.close()

        server = await asyncio.start_server(impostor, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]

        class Impostor(Body):
            async def open_channel(self) -> str:
                return f"127.0.0.1:{port}"

        try:
            with pytest.raises(EngineUnavailable, match="server's proof is wrong"):
                await EngineChannel("prefill-0", LocalActor(Impostor()), SECRET).connect()
        finally:
            server.close()

    asyncio.run(main())


# ---- someone on the path, without the secret


class Relay:
    """An on-path relay holding no secret: passes one connection's bytes both ways, keeps a copy
    of each direction, and can write bytes of its own toward the engine."""

    def __init__(self, engine_address: str):
        self.engine_host, _, port = engine_address.rpartition(":")
        self.engine_port = int(port)
        self.to_engine, self.to_router = bytearray(), bytearray()
        self.engine_closed = asyncio.Event()
        self._to_engine_writer: asyncio.StreamWriter | None = None

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        return f"127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def _relay(self, router_r, router_w) -> None:
        engine_r, engine_w = await asyncio.open_connection(self.engine_host, self.engine_port)
        self._to_engine_writer = engine_w

        async def pump(reader, writer, copy, closed=None):
            while data := await reader.read(1 << 16):
                copy += data
                writer.write(data)
            writer.close()
            if closed is not None:
                closed.set()

        await asyncio.gather(pump(router_r, engine_w, self.to_engine),
                             pump(engine_r, router_w, self.to_router, self.engine_closed))

    def inject(self, data: bytes) -> None:
        self._to_engine_writer.write(data)

    def close(self) -> None:
        self._server.close()


class RelayedBody(Body):
    """An engine whose advertised address is a relay's in front of its real one."""

    relay: Relay

    async def open_channel(self) -> str:
        self.relay = Relay(await super().open_channel())
        return await self.relay.start()


@pytest.mark.parametrize("injected", ["a frame replayed", "a frame of its own"])
def test_a_relay_without_the_secret_reads_no_prompt_and_injects_nothing(injected, caplog):
    """The handshake passes through a relay; what follows it is sealed: the relay sees neither the
    prompt's ids nor the request id, and a frame it replays or makes is refused, never run."""
    import msgspec

    from pdcluster.proto.messages import PrefillRequest
    from pdcluster.transfer.auth import CLIENT_PROOF_BYTES
    from pdcluster.transfer.channel_wire import PrefillCall

    prompt = list(range(70_000, 70_064))

    async def main():
        actor, ch = await connected(RelayedBody())
        relay = actor.body.relay
        result = await asyncio.wait_for(ch.call("prefill", PrefillRequest("private-req", prompt, SAMPLING)).next(), 5)
        assert result.request_id == "private-req"
        frames = bytes(relay.to_engine[CLIENT_PROOF_BYTES:])  # the router's frames after its proof
        if injected == "a frame replayed":
            relay.inject(frames)
        else:
            own = msgspec.msgpack.encode([PrefillCall(7, PrefillRequest("injected", [1, 2, 3], SAMPLING))])
            relay.inject(len(own).to_bytes(4, "big") + own)
        await asyncio.wait_for(relay.engine_closed.wait(), 5)
        ch.close()
        relay.close()
        return bytes(relay.to_engine), bytes(relay.to_router), actor.body.prefills

    to_engine, to_router, prefills = asyncio.run(main())
    assert msgspec.msgpack.encode(prompt) not in to_engine and b"private-req" not in to_engine
    assert b"private-req" not in to_router
    assert prefills == 1, f"the engine ran {injected}"
    assert "a frame that does not authenticate" in caplog.text
