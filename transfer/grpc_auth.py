"""gRPC's proof of the cluster secret (transfer/auth.py): a token per call, bound to its server and body.

Every call to P's KV service (and the channel store inside it) carries a `pdc-auth` metadata
token: an HMAC of the method, the server's name (P's engine id), a time, a nonce and the
SHA-256 of the request's body (`GrpcAuth`). The server interceptor checks the token before
the handler runs (a caller without the secret is refused at its headers); the body is checked
against the token's digest before it is parsed. A token is good for one call within
`window_s` of its time (hosts' clocks must agree that well), on that one server, with that one
body: sniffed on its way to one P, it is refused by every other P, and with another body by
all of them; a nonce seen again is a replay. A P restarted under the same name forgets its
nonces, so a token sniffed before the restart can repeat that same call within the window once.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import threading
import time
from collections import OrderedDict

import grpc

from pdcluster.transfer.auth import NONCE_BYTES, Refusals, _mac, derive

log = logging.getLogger(__name__)

AUTH_METADATA_KEY = "pdc-auth"
TOKEN_WINDOW_S = 300.0


def body_digest(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()


class GrpcAuth:
    """Makes and checks per-call tokens: "<unix ms>.<nonce hex>.<body SHA-256 hex>.<HMAC hex of
    method, server, ms, nonce, digest>".

    Thread-safe (a gRPC server checks from its pool threads)."""

    def __init__(self, secret: str, window_s: float = TOKEN_WINDOW_S):
        self._key = derive(secret, "grpc")
        self.window_s = window_s
        self._seen: OrderedDict[str, float] = OrderedDict()  # nonce -> its token's time, oldest first
        self._lock = threading.Lock()

    def _sign(self, method: str, server: str, ms: str, nonce: str, digest: str) -> str:
        return _mac(self._key, method.encode(), server.encode(), ms.encode(), nonce.encode(), digest.encode()).hex()

    def token(self, method: str, server: str, body: bytes, now_s: float | None = None) -> str:
        """A token for one call of `method` on `server` (its engine id) carrying `body` (the request's bytes)."""
        ms = str(int((time.time() if now_s is None else now_s) * 1000))
        nonce, digest = os.urandom(NONCE_BYTES).hex(), body_digest(body)
        return f"{ms}.{nonce}.{digest}.{self._sign(method, server, ms, nonce, digest)}"

    def check(self, method: str, server: str, token: str | None,
              now_s: float | None = None) -> tuple[str | None, str | None]:
        """(None, the body digest the call must carry) if `token` is good for this call of `method`
        on `server`; else (why not, None). Spends the token's nonce."""
        if not token:
            return f"no {AUTH_METADATA_KEY} token", None
        parts = token.split(".")
        if len(parts) != 4 or not parts[0].isdigit():
            return f"a malformed {AUTH_METADATA_KEY} token", None
        ms, nonce, digest, mac = parts
        if not hmac.compare_digest(mac.encode(), self._sign(method, server, ms, nonce, digest).encode()):
            return "a wrong token (the caller does not hold this cluster's secret, or it was meant for another server)", None
        now = time.time() if now_s is None else now_s
        at = int(ms) / 1000
        if abs(now - at) > self.window_s:
            return (f"a token {now - at:+.0f} s from this host's clock (outside {self.window_s:.0f} s; "
                    "clocks unsynced?)"), None
        with self._lock:
            while self._seen and next(iter(self._seen.values())) < now - self.window_s:
                self._seen.popitem(last=False)
            if nonce in self._seen:
                return "a replayed token", None
            self._seen[nonce] = at
        return None, digest


# What a client of the KV service is told of a refusal (it sees UNIMPLEMENTED: see the interceptor).
REFUSED_HINT = ("refused the call: it does not take this cluster's secret (auth.secret / PDC_CLUSTER_SECRET "
                "must be the same on every host), or it is not a pdcluster KV service")


def is_refusal(err: grpc.RpcError) -> bool:
    """Whether a call to a KV service failed because the service refused it (no good token)."""
    return err.code() == grpc.StatusCode.UNIMPLEMENTED


class _Tampered:
    """What a body that is not the one its token covers deserializes to: the handler refuses it."""


def _bound_to_body(handler: grpc.RpcMethodHandler, digest: str, refuse) -> grpc.RpcMethodHandler:
    """`handler` whose request must hash to `digest` (checked on the raw bytes, before parsing)."""
    parse = handler.request_deserializer

    def deserialize(raw: bytes):
        if not hmac.compare_digest(body_digest(raw), digest):
            return _Tampered
        return raw if parse is None else parse(raw)

    def checked(behaviour):
        def run(request, context):
            if request is _Tampered:
                refuse()
                context.abort(grpc.StatusCode.UNAUTHENTICATED, "the request's body is not the one its token covers")
            return behaviour(request, context)
        return run

    kind = "unary_unary" if handler.unary_unary is not None else "unary_stream"
    assert getattr(handler, kind) is not None, "the KV service has only unary requests"
    return handler._replace(request_deserializer=deserialize, **{kind: checked(getattr(handler, kind))})


def grpc_server_interceptor(auth: GrpcAuth, server: str, service_name: str):
    """A grpc.ServerInterceptor refusing calls without a good token for `server` (this P's engine
    id) before anything of them runs, and calls whose body is not the token's before it is parsed.

    A call without a good token gets no handler: gRPC answers it UNIMPLEMENTED from its serving
    thread, reading none of the request and taking no pool thread (a handler that aborted would
    first wait in a pool thread for the whole request message: 68 silent calls stalled every
    legitimate one, and 60 MiB bodies were buffered). A good token with another body (someone on
    the path) is answered UNAUTHENTICATED. Refusals are logged at a bounded rate (auth.py: Refusals)."""
    refusals = Refusals(service_name, "call(s)", "kv_service")

    class _Interceptor(grpc.ServerInterceptor):
        def intercept_service(self, continuation, details):
            token = next((v for k, v in (details.invocation_metadata or ()) if k == AUTH_METADATA_KEY), None)
            reason, digest = auth.check(details.method, server, token)
            if reason is not None:
                refusals.refused(details.method, reason)
                return None
            handler = continuation(details)
            if handler is None:
                return None
            return _bound_to_body(handler, digest,
                                  lambda: refusals.refused(details.method, "a body other than its token's"))

    return _Interceptor()


def grpc_authenticated_channel(channel, auth: GrpcAuth, server: str):
    """`channel` to `server` (its engine id) with a fresh token for each call's method and body."""

    class _Details(grpc.ClientCallDetails):
        def __init__(self, d, metadata):
            self.method, self.timeout, self.metadata = d.method, d.timeout, metadata
            self.credentials, self.wait_for_ready, self.compression = d.credentials, d.wait_for_ready, d.compression

    class _Interceptor(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
        def _details(self, d, request):
            method = d.method.decode() if isinstance(d.method, bytes) else d.method
            # The KV service's messages have no maps: one message serializes to the same bytes every time.
            body = request if isinstance(request, bytes) else request.SerializeToString()
            token = auth.token(method, server, body)
            return _Details(d, [*(d.metadata or ()), (AUTH_METADATA_KEY, token)])

        def intercept_unary_unary(self, continuation, details, request):
            return continuation(self._details(details, request), request)

        def intercept_unary_stream(self, continuation, details, request):
            return continuation(self._details(details, request), request)

    return grpc.intercept_channel(channel, _Interceptor())
