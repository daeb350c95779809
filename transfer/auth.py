"""The cluster secret, and how every plane proves it knows it before anything else is read.

One secret per cluster: the spec's `auth.secret`, else the env var PDC_CLUSTER_SECRET
(clusters whose processes other tooling starts), else one `build_cluster` generates.
It reaches the cluster's processes inside the spec (a SecretStr: dumps, logs and run
metadata show it masked) and, for vLLM's own processes, in their environment. It is
never sent: each plane proves knowledge of a key derived from it (`derive`), so a
peer that sees the traffic learns no key.

- Stream sockets (the request channel, the torch.distributed liveness pair): a
  mutual challenge-response before the first byte of payload (`ServerHandshake`,
  `ClientHandshake`, sans-I/O; `handshake_socket` for blocking sockets). The server
  reads exactly one fixed-size proof and refuses anything else, so a peer without
  the key gets nothing read, let alone deserialized. The handshake also yields the
  connection's session keys: the request channel seals every frame after it
  (transfer/session.py), so nobody on the path reads, alters or injects one.
- gRPC (P's KV service, the channel store inside it): a token per call
  (transfer/grpc_auth.py).
- ZMQ (the KV-event PUB and replay sockets): CURVE, with key pairs derived from
  the secret (`curve_keys`); the publisher's ZAP handler admits only the cluster's
  client key, and CURVE encrypts the events (they carry prompts' token ids).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import socket
import threading
import time
from dataclasses import dataclass

from pdcluster.proto.spec import secret_weakness
from pdcluster.transfer import refusal_counts
from pdcluster.transfer.session import SessionKeys, session_keys

log = logging.getLogger(__name__)

SECRET_ENV = "PDC_CLUSTER_SECRET"


class AuthError(Exception):
    """A peer failed to prove it knows the cluster secret; the message says how."""


def generate_secret() -> str:
    return secrets.token_hex(32)


def check_secret(secret: str, source: str) -> str:
    if why := secret_weakness(secret):
        raise ValueError(f"{source}: the cluster secret is {why}")
    return secret


class Refusals:
    """Peers refused on one plane, logged at most once per `every_s` (the first at once) with the
    count since the last line: a stranger's flood costs no log line per attempt. Each is counted
    for /metrics (refusal_counts.py). Thread-safe."""

    def __init__(self, what: str, unit: str, plane: str, every_s: float = 60.0, clock=time.monotonic):
        """`unit`: what is refused, for the log line ("call(s)", "connection(s)"); `plane`: its
        counter (refusal_counts.PLANES)."""
        assert plane in refusal_counts.PLANES, f"unknown plane {plane!r}"
        self.what, self.unit, self.plane, self._every_s, self._clock = what, unit, plane, every_s, clock
        self._unlogged = 0
        self._next_log = 0.0
        self._lock = threading.Lock()

    def refused(self, who: str, reason: object) -> None:
        refusal_counts.count(self.plane)
        now = self._clock()
        with self._lock:
            self._unlogged += 1
            if now < self._next_log:
                return
            n, self._unlogged, self._next_log = self._unlogged, 0, now + self._every_s
        log.warning("%s: refused %d %s since the last such line (latest: %s, %s)", self.what, n, self.unit, who,
                    reason)


def derive(secret: str, purpose: str) -> bytes:
    """A 32-byte key for one purpose: knowing one purpose's key tells nothing of another's."""
    return hmac.new(secret.encode(), b"pdcluster/" + purpose.encode(), hashlib.sha256).digest()


def _mac(key: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, b"\0".join(parts), hashlib.sha256).digest()


# ---------------------------------------------------------------------- stream sockets

MAGIC = b"PDC1"
NONCE_BYTES = 16
MAC_BYTES = 32
SERVER_HELLO_BYTES = len(MAGIC) + NONCE_BYTES  # magic, server nonce
CLIENT_PROOF_BYTES = len(MAGIC) + NONCE_BYTES + MAC_BYTES  # magic, client nonce, client MAC
HANDSHAKE_TIMEOUT_S = 5.0  # a server closes a connection that has not proved itself by then


@dataclass(frozen=True)
class Step:
    """What a handshake wants done after `feed`: bytes to send, and whether it is over
    (then `leftover` is payload that came after it)."""

    send: bytes = b""
    done: bool = False
    leftover: bytes = b""
    session: SessionKeys | None = None  # once done: the keys sealing this connection's frames (session.py)


class ServerHandshake:
    """The listening side: says hello (its nonce), reads the client's proof, proves itself.

    Protocol (fixed sizes, nothing else is read before it completes):
      server -> client  MAGIC + nonce_s
      client -> server  MAGIC + nonce_c + HMAC(k, "client", nonce_s, nonce_c)
      server -> client  HMAC(k, "server", nonce_s, nonce_c)
    """

    def __init__(self, key: bytes):
        self._key = key
        self._nonce = os.urandom(NONCE_BYTES)
        self._got = bytearray()
        self.done = False

    def hello(self) -> bytes:
        return MAGIC + self._nonce

    def feed(self, data: bytes) -> Step:
        """Raises AuthError on a wrong proof (or one that does not start like ours)."""
        assert not self.done, "handshake fed after it ended: the connection should have switched to payload"
        self._got += data
        if not self._got[:len(MAGIC)] == MAGIC[:len(self._got)]:
            raise AuthError("the peer did not open with pdcluster's handshake (not a cluster process, or garbage)")
        if len(self._got) < CLIENT_PROOF_BYTES:
            return Step()
        proof, leftover = bytes(self._got[:CLIENT_PROOF_BYTES]), bytes(self._got[CLIENT_PROOF_BYTES:])
        nonce_c, mac_c = proof[len(MAGIC):len(MAGIC) + NONCE_BYTES], proof[len(MAGIC) + NONCE_BYTES:]
        if not hmac.compare_digest(mac_c, _mac(self._key, b"client", self._nonce, nonce_c)):
            raise AuthError("the peer's proof is wrong (it does not hold this cluster's secret)")
        self.done = True
        return Step(_mac(self._key, b"server", self._nonce, nonce_c), True, leftover,
                    session_keys(self._key, self._nonce, nonce_c, server=True))


class ClientHandshake:
    """The connecting side: answers the server's hello with its proof, checks the server's."""

    def __init__(self, key: bytes):
        self._key = key
        self._nonce = os.urandom(NONCE_BYTES)
        self._got = bytearray()
        self._server_nonce: bytes | None = None
        self.done = False

    def feed(self, data: bytes) -> Step:
        assert not self.done, "handshake fed after it ended"
        self._got += data
        if self._server_nonce is None:
            if len(self._got) < SERVER_HELLO_BYTES:
                return Step()
            if self._got[:len(MAGIC)] != MAGIC:
                raise AuthError("the server did not open with pdcluster's handshake")
            self._server_nonce = bytes(self._got[len(MAGIC):SERVER_HELLO_BYTES])
            del self._got[:SERVER_HELLO_BYTES]
            proof = MAGIC + self._nonce + _mac(self._key, b"client", self._server_nonce, self._nonce)
            return self._finish(proof)
        return self._finish(b"")

    def _finish(self, send: bytes) -> Step:
        if len(self._got) < MAC_BYTES:
            return Step(send)
        mac_s, leftover = bytes(self._got[:MAC_BYTES]), bytes(self._got[MAC_BYTES:])
        if not hmac.compare_digest(mac_s, _mac(self._key, b"server", self._server_nonce, self._nonce)):
            raise AuthError("the server's proof is wrong (it does not hold this cluster's secret)")
        self.done = True
        return Step(send, True, leftover, session_keys(self._key, self._server_nonce, self._nonce, server=False))


def handshake_socket(sock: socket.socket, key: bytes, server: bool, timeout_s: float = HANDSHAKE_TIMEOUT_S) -> bytes:
    """Run the handshake on a connected blocking socket; returns payload bytes that came
    after it (usually none). Raises AuthError (wrong proof) or OSError/TimeoutError."""
    deadline = time.monotonic() + timeout_s
    hs: ServerHandshake | ClientHandshake = ServerHandshake(key) if server else ClientHandshake(key)
    before = sock.gettimeout()
    try:
        if server:
            sock.sendall(hs.hello())
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError("the peer did not complete the handshake in time")
            sock.settimeout(remaining)
            data = sock.recv(CLIENT_PROOF_BYTES if server else SERVER_HELLO_BYTES + MAC_BYTES)
            if not data:
                raise AuthError("the peer closed the connection during the handshake")
            step = hs.feed(data)
            if step.send:
                sock.sendall(step.send)
            if step.done:
                return step.leftover
    finally:
        sock.settimeout(before)


# ---------------------------------------------------------------------- ZMQ (CURVE)

ZAP_DOMAIN = "pdcluster"


@dataclass(frozen=True)
class CurveKeys:
    """Z85 CURVE key pairs of a cluster's publishers (server) and subscribers (client)."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes

    def __repr__(self) -> str:
        return "CurveKeys(<derived from the cluster secret>)"


def curve_keys(secret: str) -> CurveKeys:
    import zmq
    from zmq.utils import z85

    server_secret = z85.encode(derive(secret, "zmq-curve-server"))
    client_secret = z85.encode(derive(secret, "zmq-curve-client"))
    return CurveKeys(zmq.curve_public(server_secret), server_secret, zmq.curve_public(client_secret), client_secret)


class _ClusterClients:
    """A ZAP credentials provider: the client keys of the clusters served from one ZMQ context."""

    def __init__(self) -> None:
        self.keys: dict[bytes, str] = {}  # client public key -> the name of what it may reach
        self.refusals = Refusals("ZMQ (CURVE)", "peer(s) with an unknown key", "kv_events")

    def callback(self, domain: str, client_key: bytes) -> bool:
        if any(hmac.compare_digest(client_key, k) for k in self.keys):
            return True
        self.refusals.refused(", ".join(sorted(set(self.keys.values()))), "no cluster secret")
        return False


_zap: dict[int, tuple[object, _ClusterClients]] = {}  # id(zmq context) -> its ZAP handler, its admitted keys
_zap_lock = threading.Lock()


def zmq_secure_server(sock, keys: CurveKeys, name: str) -> None:
    """Make `sock` (before it binds) a CURVE server that admits only the cluster's client key;
    the first call per context starts that context's ZAP handler (a thread). `name`: what
    the socket serves, for the log line of a refusal."""
    from zmq.auth.thread import ThreadAuthenticator

    ctx = sock.context
    with _zap_lock:
        if id(ctx) not in _zap:
            handler, clients = ThreadAuthenticator(ctx, log=logging.getLogger(f"{__name__}.zap")), _ClusterClients()
            handler.start()
            handler.configure_curve_callback(ZAP_DOMAIN, credentials_provider=clients)
            _zap[id(ctx)] = (handler, clients)
        _zap[id(ctx)][1].keys[keys.client_public] = name
    sock.zap_domain = ZAP_DOMAIN.encode()
    sock.curve_secretkey = keys.server_secret
    sock.curve_publickey = keys.server_public
    sock.curve_server = True


def zmq_stop_auth(ctx) -> None:
    """Stop `ctx`'s ZAP handler, if it has one (before `ctx.term()`, which waits for its socket)."""
    with _zap_lock:
        entry = _zap.pop(id(ctx), None)
    if entry is not None:
        entry[0].stop()


def zmq_secure_client(sock, keys: CurveKeys) -> None:
    """Make `sock` (before it connects) a CURVE client of the cluster's publishers."""
    sock.curve_serverkey = keys.server_public
    sock.curve_publickey = keys.client_public
    sock.curve_secretkey = keys.client_secret
