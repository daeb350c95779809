"""transfer/auth.py: the handshake, gRPC tokens and CURVE keys, each against a wrong secret too."""

from __future__ import annotations

import secrets
import socket
import threading
import time
from concurrent import futures
from dataclasses import replace

import grpc
import pytest

from pdcluster.transfer import refusal_counts
from pdcluster.transfer.auth import (
    AuthError,
    ClientHandshake,
    ServerHandshake,
    check_secret,
    curve_keys,
    derive,
    handshake_socket,
    zmq_secure_client,
    zmq_secure_server,
    zmq_stop_auth,
)
from pdcluster.transfer.grpc_auth import (
    AUTH_METADATA_KEY,
    GrpcAuth,
    body_digest,
    grpc_authenticated_channel,
    grpc_server_interceptor,
)

SECRET = "3f1c9a7e5b2d8c4f6a0e1b7d9c3f5a2e"
OTHER = "o" * 32


def run_handshake(server_key: bytes, client_key: bytes, chunk: int = 1 << 20, payload: bytes = b""):
    """Both sides in memory, bytes delivered `chunk` at a time; returns (server leftover, client leftover)."""
    server, client = ServerHandshake(server_key), ClientHandshake(client_key)
    to_client, to_server = server.hello(), b""
    server_left = client_left = None
    while server_left is None or client_left is None:
        if to_client:
            piece, to_client = to_client[:chunk], to_client[chunk:]
            step = client.feed(piece)
            to_server += step.send
            if step.done:
                client_left = step.leftover
                to_server += payload
        elif to_server:
            piece, to_server = to_server[:chunk], to_server[chunk:]
            step = server.feed(piece)
            to_client += step.send
            if step.done and server_left is None:
                server_left = step.leftover
        else:
            raise AssertionError("handshake stalled")
    return server_left + to_server, client_left


@pytest.mark.parametrize("chunk", [1, 7, 1 << 20])
def test_handshake_succeeds_whatever_the_pieces(chunk):
    key = derive(SECRET, "stream")
    server_left, client_left = run_handshake(key, key, chunk, payload=b"frame")
    assert server_left == b"frame" and client_left == b""


def test_handshake_refuses_a_wrong_key_on_both_sides():
    with pytest.raises(AuthError, match="peer's proof is wrong"):
        run_handshake(derive(SECRET, "stream"), derive(OTHER, "stream"))


def test_client_refuses_a_server_without_the_key():
    key, wrong = derive(SECRET, "stream"), derive(OTHER, "stream")
    client = ClientHandshake(key)
    impostor = ServerHandshake(wrong)
    proof = client.feed(impostor.hello()).send
    # The impostor cannot check the proof; it answers with a MAC of its own key.
    with pytest.raises(AuthError, match="peer's proof"):
        impostor.feed(proof)
    with pytest.raises(AuthError, match="server's proof is wrong"):
        client.feed(b"\0" * 32)


@pytest.mark.parametrize("garbage", [b"GET / HTTP/1.1\r\n", b"\x80\x05\x95", b"P"])
def test_server_refuses_garbage_at_its_first_byte(garbage):
    server = ServerHandshake(derive(SECRET, "stream"))
    server.hello()
    if garbage == b"P":  # a prefix of the magic is not refused yet...
        assert not server.feed(garbage).done
        garbage = b"X"  # ...the next wrong byte is
    with pytest.raises(AuthError, match="did not open with pdcluster's handshake"):
        server.feed(garbage)


def test_handshake_socket_both_ends_and_a_silent_peer_times_out():
    key = derive(SECRET, "stream")
    a, b = socket.socketpair()
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("server", handshake_socket(a, key, server=True)))
    t.start()
    assert handshake_socket(b, key, server=False) == b""
    t.join(5)
    assert out["server"] == b""
    c, d = socket.socketpair()
    with pytest.raises(TimeoutError):
        handshake_socket(c, key, server=True, timeout_s=0.2)  # d never answers
    for s in (a, b, c, d):
        s.close()


def test_check_secret_names_the_source_and_refuses_a_guessable_one():
    """Issue 26 item 10: "pdcluster-prod-2025" fell in 119 offline guesses from one handshake."""
    for weak in ("short", "pdcluster-prod-2025", "s" * 64, "from-the-spec-0123"):
        with pytest.raises(ValueError, match="auth.secret: the cluster secret is too weak.*secrets.token_hex"):
            check_secret(weak, "auth.secret")
    for strong in (SECRET, secrets.token_hex(16), secrets.token_urlsafe(22), "dist-channel-test-secret-0123"):
        assert check_secret(strong, "x") == strong


# -- gRPC tokens


def test_token_is_good_once_for_its_method_server_and_time():
    auth = GrpcAuth(SECRET)
    token = auth.token("/svc/A", "p0", b"body", now_s=1000.0)
    assert auth.check("/svc/A", "p0", token, now_s=1001.0) == (None, body_digest(b"body"))
    assert auth.check("/svc/A", "p0", token, now_s=1001.0) == ("a replayed token", None)
    fresh = lambda: auth.token("/svc/A", "p0", b"body", now_s=1000.0)  # noqa: E731
    assert "wrong token" in auth.check("/svc/B", "p0", fresh(), now_s=1000.0)[0]
    assert "meant for another server" in auth.check("/svc/A", "p1", fresh(), now_s=1000.0)[0]
    # Another P of the cluster (its own replay memory) refuses a token sniffed on its way to p0.
    assert "meant for another server" in GrpcAuth(SECRET).check("/svc/A", "p1", fresh(), now_s=1000.0)[0]
    assert "wrong token" in GrpcAuth(OTHER).check("/svc/A", "p0", fresh(), now_s=1000.0)[0]
    assert "outside 300 s" in auth.check("/svc/A", "p0", fresh(), now_s=1400.0)[0]
    assert auth.check("/svc/A", "p0", None) == (f"no {AUTH_METADATA_KEY} token", None)
    assert auth.check("/svc/A", "p0", "x.y") == (f"a malformed {AUTH_METADATA_KEY} token", None)
    # The digest is under the MAC: a token whose digest was swapped for another body's is wrong.
    ms, nonce, _, mac = fresh().split(".")
    assert "wrong token" in auth.check("/svc/A", "p0", ".".join((ms, nonce, body_digest(b"evil"), mac)))[0]


def test_replay_memory_is_bounded_by_the_window():
    auth = GrpcAuth(SECRET, window_s=10)
    for i in range(100):
        assert auth.check("/m", "p0", auth.token("/m", "p0", b"", now_s=float(i)), now_s=float(i))[0] is None
    assert len(auth._seen) <= 11


class _Echo:
    """A generic gRPC service whose handler and deserializer count their calls."""

    def __init__(self):
        self.deserialized = self.handled = 0

    def deserialize(self, raw: bytes) -> bytes:
        self.deserialized += 1
        return raw

    def handle(self, request: bytes, context) -> bytes:
        self.handled += 1
        return b"echo:" + request

    def handlers(self):
        return grpc.method_handlers_generic_handler("t.Echo", {
            "Call": grpc.unary_unary_rpc_method_handler(self.handle, request_deserializer=self.deserialize)})


@pytest.fixture
def echo_server():
    service = _Echo()
    server = grpc.server(futures.ThreadPoolExecutor(2),
                         interceptors=[grpc_server_interceptor(GrpcAuth(SECRET), "echo-0", "echo")])
    server.add_generic_rpc_handlers((service.handlers(),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield service, f"127.0.0.1:{port}"
    server.stop(0)


def _call(address: str, secret: str | None, payload: bytes = b"hi", server: str = "echo-0") -> bytes:
    with grpc.insecure_channel(address) as raw:
        channel = raw if secret is None else grpc_authenticated_channel(raw, GrpcAuth(secret), server)
        return channel.unary_unary("/t.Echo/Call")(payload, timeout=5)


def test_grpc_refuses_callers_without_the_secret_before_deserializing(echo_server, caplog):
    service, address = echo_server
    before = refusal_counts.read()
    for secret in (None, OTHER):
        with pytest.raises(grpc.RpcError) as err:
            _call(address, secret, b"\x80\x05 a pickle would be here")
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert service.deserialized == service.handled == 0
    assert refusal_counts.read() == replace(before, kv_service=before.kv_service + 2)  # for /metrics
    assert "echo: refused 1 call(s) since the last such line (latest: /t.Echo/Call" in caplog.text
    assert _call(address, SECRET) == b"echo:hi"  # and it still serves the cluster
    assert service.handled == 1


def test_grpc_refuses_a_token_for_another_server_or_with_another_body(echo_server):
    """What someone on the path can do with a sniffed token: send it to another P (refused at its
    headers), or with a body of its own to the P it was meant for (refused before parsing)."""
    service, address = echo_server
    with pytest.raises(grpc.RpcError) as err:
        _call(address, SECRET, server="echo-1")  # a token made for another server
    assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
    token = GrpcAuth(SECRET).token("/t.Echo/Call", "echo-0", b"hi")
    with grpc.insecure_channel(address) as raw, pytest.raises(grpc.RpcError) as err:
        raw.unary_unary("/t.Echo/Call")(b"evil", metadata=[(AUTH_METADATA_KEY, token)], timeout=5)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert service.deserialized == service.handled == 0


# -- ZMQ CURVE


def test_curve_keys_are_derived_and_differ_per_secret():
    a, b = curve_keys(SECRET), curve_keys(OTHER)
    assert a == curve_keys(SECRET) and a.server_public != b.server_public
    assert "derived" in repr(a) and SECRET not in repr(a)


def test_curve_pub_sub_admits_only_the_cluster():
    import zmq

    keys = curve_keys(SECRET)
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    zmq_secure_server(pub, keys, "test publisher")
    port = pub.bind_to_random_port("tcp://127.0.0.1")

    def subscriber(k):
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        if k is not None:
            zmq_secure_client(sub, k)
        sub.connect(f"tcp://127.0.0.1:{port}")
        return sub

    # stranger: knows the publisher's public key, but its own key pair is not the cluster's (ZAP refuses it)
    public, secret = zmq.curve_keypair()
    stranger_keys = type(keys)(keys.server_public, keys.server_secret, public, secret)
    before = refusal_counts.read().kv_events
    good, plain, wrong = subscriber(keys), subscriber(None), subscriber(curve_keys(OTHER))
    stranger = subscriber(stranger_keys)  # the one whose key reaches ZAP (the others fail CURVE before it)
    deadline = time.monotonic() + 10
    while not good.poll(50):
        pub.send(b"event")
        assert time.monotonic() < deadline, "the cluster's subscriber got nothing"
    for _ in range(5):
        pub.send(b"event")
    time.sleep(0.3)
    assert good.recv() == b"event"
    assert not plain.poll(0) and not wrong.poll(0) and not stranger.poll(0)
    assert refusal_counts.read().kv_events - before >= 1  # ZMQ retries the stranger's handshake: once or more
    for s in (good, plain, wrong, stranger, pub):
        s.close(linger=0)
    zmq_stop_auth(ctx)
    ctx.term()
