"""gRPC's proof of the cluster secret (transfer/auth.py): a token per call.

Every call to P's KV service (and the channel store inside it) carries a `pdc-auth` metadata
token, an HMAC of the method, a time and a nonce (`GrpcAuth`); the server interceptor checks it
before the handler and its request deserializer run. A token is good for one call within
`window_s` of its time (hosts' clocks must agree that well); a nonce seen again is a replay.
"""

from __future__ import annotations

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


class GrpcAuth:
    """Makes and checks per-call tokens: "<unix ms>.<nonce hex>.<HMAC hex of method, ms, nonce>".

    Thread-safe (a gRPC server checks from its pool threads)."""

    def __init__(self, secret: str, window_s: float = TOKEN_WINDOW_S):
        self._key = derive(secret, "grpc")
        self.window_s = window_s
        self._seen: OrderedDict[str, float] = OrderedDict()  # nonce -> its token's time, oldest first
        self._lock = threading.Lock()

    def token(self, method: str, now_s: float | None = None) -> str:
        ms = str(int((time.time() if now_s is None else now_s) * 1000))
        nonce = os.urandom(NONCE_BYTES).hex()
        return f"{ms}.{nonce}.{_mac(self._key, method.encode(), ms.encode(), nonce.encode()).hex()}"

    def check(self, method: str, token: str | None, now_s: float | None = None) -> str | None:
        """None if `token` is good for this call of `method`; else why not."""
        if not token:
            return f"no {AUTH_METADATA_KEY} token"
        parts = token.split(".")
        if len(parts) != 3 or not parts[0].isdigit():
            return f"a malformed {AUTH_METADATA_KEY} token"
        ms, nonce, mac = parts
        if not hmac.compare_digest(mac.encode(), _mac(self._key, method.encode(), ms.encode(),
                                                      nonce.encode()).hex().encode()):
            return "a wrong token (the caller does not hold this cluster's secret)"
        now = time.time() if now_s is None else now_s
        at = int(ms) / 1000
        if abs(now - at) > self.window_s:
            return f"a token {now - at:+.0f} s from this host's clock (outside {self.window_s:.0f} s; clocks unsynced?)"
        with self._lock:
            while self._seen and next(iter(self._seen.values())) < now - self.window_s:
                self._seen.popitem(last=False)
            if nonce in self._seen:
                return "a replayed token"
            self._seen[nonce] = at
        return None


# What a client of the KV service is told of a refusal (it sees UNIMPLEMENTED: see the interceptor).
REFUSED_HINT = ("refused the call: it does not take this cluster's secret (auth.secret / PDC_CLUSTER_SECRET "
                "must be the same on every host), or it is not a pdcluster KV service")


def is_refusal(err: grpc.RpcError) -> bool:
    """Whether a call to a KV service failed because the service refused it (no good token)."""
    return err.code() == grpc.StatusCode.UNIMPLEMENTED


def grpc_server_interceptor(auth: GrpcAuth, service_name: str):
    """A grpc.ServerInterceptor refusing calls without a good token before anything of them runs.

    A refused call gets no handler: gRPC answers it UNIMPLEMENTED from its serving thread, reading
    none of the request and taking no pool thread (a handler that aborted would first wait in a
    pool thread for the whole request message: 68 silent calls stalled every legitimate one, and
    60 MiB bodies were buffered). Refusals are logged at a bounded rate (auth.py: Refusals)."""
    refusals = Refusals(service_name, "call(s)")

    class _Interceptor(grpc.ServerInterceptor):
        def intercept_service(self, continuation, details):
            token = next((v for k, v in (details.invocation_metadata or ()) if k == AUTH_METADATA_KEY), None)
            reason = auth.check(details.method, token)
            if reason is None:
                return continuation(details)
            refusals.refused(details.method, reason)
            return None

    return _Interceptor()


def grpc_authenticated_channel(channel, auth: GrpcAuth):
    """`channel` with a fresh token added to every call's metadata."""

    class _Details(grpc.ClientCallDetails):
        def __init__(self, d, metadata):
            self.method, self.timeout, self.metadata = d.method, d.timeout, metadata
            self.credentials, self.wait_for_ready, self.compression = d.credentials, d.wait_for_ready, d.compression

    class _Interceptor(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
        def _details(self, d):
            method = d.method.decode() if isinstance(d.method, bytes) else d.method
            return _Details(d, [*(d.metadata or ()), (AUTH_METADATA_KEY, auth.token(method))])

        def intercept_unary_unary(self, continuation, details, request):
            return continuation(self._details(details), request)

        def intercept_unary_stream(self, continuation, details, request):
            return continuation(self._details(details), request)

    return grpc.intercept_channel(channel, _Interceptor())
