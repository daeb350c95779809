"""The request channel (transfer/request_channel.py) against peers without the cluster secret:
refused, nothing unpickled, silent ones dropped, and a router that refuses such an engine."""

from __future__ import annotations

import asyncio

import pytest
from channel_fakes import SECRET, Body, LocalActor, connected, prefill_req
from e2e import evil_pickle

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
        # A peer that proves the secret and then sends a pickled frame: not decoded as one.
        reader, writer = await asyncio.open_connection(host, int(port))
        hs = ClientHandshake(channel_key(SECRET))
        writer.write(hs.feed(await reader.readexactly(20)).send)
        assert hs.feed(await reader.readexactly(32)).done
        frame = evil_pickle(marker)
        writer.write(len(frame).to_bytes(4, "big") + frame)
        assert await asyncio.wait_for(reader.read(), 5) == b"", "the engine kept a connection that sent pickle"
        writer.close()
        after = await asyncio.wait_for(ch.call("prefill", prefill_req("after")).next(), 5)  # still serving
        server = actor.body._channel
        ch.close()
        return after, server.refused, actor.body.prefills

    after, refused, prefills = asyncio.run(main())
    assert after.request_id == "after" and prefills == 1
    assert refused == 3  # the wrong secret, the garbage, the pickle sent as a handshake
    assert not marker.exists()
    assert caplog.text.count("refused 127.0.0.1:") == 3 and "a frame does not decode" in caplog.text


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
