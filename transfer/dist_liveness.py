"""Knowing a torch.distributed pair's peer is gone (transfer/dist_channel.py): a plain TCP
connection beside the process group, proven with the cluster secret, with keepalives, whose only
job is to close when the peer dies; a thread watches it and says why."""

from __future__ import annotations

import selectors
import socket
import time

import torch.distributed as dist

# The liveness connection: its peer's host vanishing (no FIN) ends it within ~11 s.
_KEEPALIVE = ((socket.SO_KEEPALIVE, 1, socket.SOL_SOCKET), (socket.TCP_KEEPIDLE, 5, socket.IPPROTO_TCP),
              (socket.TCP_KEEPINTVL, 2, socket.IPPROTO_TCP), (socket.TCP_KEEPCNT, 3, socket.IPPROTO_TCP))


MAX_PENDING = 16  # connections P handshakes at once while it waits for D's (more are closed at once)


def _liveness_pair(rank: int, store: dist.Store, key: str, local_host: str, deadline: float,
                   auth_key: bytes) -> socket.socket:
    """A plain TCP connection beside the process group whose only job is to close when the peer
    dies; both ends prove the cluster secret first (P drops whatever else connects)."""
    from pdcluster.transfer.auth import handshake_socket
    from pdcluster.transfer.network import host_port

    if rank == 0:
        listener = socket.create_server((local_host, 0))
        try:
            store.set(key, host_port(local_host, listener.getsockname()[1]))
            conn = _first_proven(listener, auth_key, deadline)
        finally:
            listener.close()
    else:
        host, port = store.get(key).decode().rsplit(":", 1)
        conn = socket.create_connection((host.strip("[]"), int(port)), timeout=max(deadline - time.monotonic(), 0.01))
        handshake_socket(conn, auth_key, server=False, timeout_s=max(0.01, deadline - time.monotonic()))
    for opt, value, level in _KEEPALIVE:
        conn.setsockopt(level, opt, value)
    conn.settimeout(None)
    return conn


def _first_proven(listener: socket.socket, auth_key: bytes, deadline: float) -> socket.socket:
    """The first connection to prove the key. The handshakes run side by side in this thread (the
    sans-I/O ServerHandshake over non-blocking sockets): each peer costs a socket and at most one
    proof's bytes, never a thread, and one that stays silent past HANDSHAKE_TIMEOUT_S, or any
    past MAX_PENDING, is dropped, so none holds up D's (one silent peer used to take the whole
    open deadline)."""
    from pdcluster.transfer.auth import (
        CLIENT_PROOF_BYTES,
        HANDSHAKE_TIMEOUT_S,
        AuthError,
        Refusals,
        ServerHandshake,
    )

    refusals = Refusals("channel liveness socket", "connection(s)", "channel_liveness")
    pending: dict[socket.socket, tuple[ServerHandshake, float, int, str]] = {}  # conn -> (its handshake, drop-by time, bytes read, peer)
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ)

    def drop(conn: socket.socket, why: object) -> None:
        refusals.refused(pending.pop(conn)[3], why)
        sel.unregister(conn)
        conn.close()

    try:
        while True:
            now = time.monotonic()
            if now >= deadline:
                raise TimeoutError("D never connected its liveness socket")
            for conn, (_, drop_by, _, _) in list(pending.items()):
                if now >= drop_by:
                    drop(conn, f"no proof within {HANDSHAKE_TIMEOUT_S:g} s")
            for key, _ in sel.select(timeout=min(deadline - now, 0.1)):
                conn = key.fileobj
                if conn is listener:
                    conn, peer = listener.accept()
                    if len(pending) >= MAX_PENDING:
                        refusals.refused(str(peer), f"{MAX_PENDING} handshakes pending already")
                        conn.close()
                        continue
                    handshake = ServerHandshake(auth_key)
                    conn.sendall(handshake.hello())  # 20 bytes into an empty send buffer: no wait
                    conn.setblocking(False)
                    pending[conn] = (handshake, min(deadline, now + HANDSHAKE_TIMEOUT_S), 0, str(peer))
                    sel.register(conn, selectors.EVENT_READ)
                    continue
                handshake, drop_by, read, peer = pending[conn]
                try:
                    data = conn.recv(CLIENT_PROOF_BYTES - read)  # never more than the proof
                    if not data:
                        raise ConnectionError("closed before its proof")
                    step = handshake.feed(data)
                except (AuthError, OSError) as err:
                    drop(conn, err)
                    continue
                pending[conn] = (handshake, drop_by, read + len(data), peer)
                if step.done:
                    del pending[conn]
                    sel.unregister(conn)
                    conn.setblocking(True)
                    try:
                        conn.sendall(step.send)
                    except OSError as err:
                        refusals.refused(peer, err)
                        conn.close()
                        continue
                    return conn
    finally:
        for conn in pending:
            conn.close()
        sel.close()


def channel_liveness_key(secret: str) -> bytes:
    from pdcluster.transfer.auth import derive

    return derive(secret, "channel-liveness")


class _PeerState:
    def __init__(self):
        self.gone: str | None = None
        self.closed = False


def _watch(alive: socket.socket, state: _PeerState, peer: str) -> None:
    # The peer never writes to this connection: any return is its end closing.
    try:
        why = "closed the channel or died" if not alive.recv(1) else "broke the channel protocol"
    except OSError as err:
        why = f"is unreachable ({err})"
    if not state.closed:
        state.gone = f"{peer} {why}"
