"""Knowing a torch.distributed pair's peer is gone (transfer/dist_channel.py): a plain TCP
connection beside the process group, proven with the cluster secret, with keepalives, whose only
job is to close when the peer dies; a thread watches it and says why."""

from __future__ import annotations

import logging
import socket
import time

import torch.distributed as dist

log = logging.getLogger(__name__)


# The liveness connection: its peer's host vanishing (no FIN) ends it within ~11 s.
_KEEPALIVE = ((socket.SO_KEEPALIVE, 1, socket.SOL_SOCKET), (socket.TCP_KEEPIDLE, 5, socket.IPPROTO_TCP),
              (socket.TCP_KEEPINTVL, 2, socket.IPPROTO_TCP), (socket.TCP_KEEPCNT, 3, socket.IPPROTO_TCP))


def _liveness_pair(rank: int, store: dist.Store, key: str, local_host: str, deadline: float,
                   auth_key: bytes) -> socket.socket:
    """A plain TCP connection beside the process group whose only job is to close when the peer
    dies; both ends prove the cluster secret first (P drops whatever else connects)."""
    from pdcluster.transfer.auth import AuthError, handshake_socket
    from pdcluster.transfer.network import host_port

    if rank == 0:
        listener = socket.create_server((local_host, 0))
        try:
            store.set(key, host_port(local_host, listener.getsockname()[1]))
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError("D never connected its liveness socket")
                listener.settimeout(remaining)
                conn, peer = listener.accept()
                try:
                    handshake_socket(conn, auth_key, server=True, timeout_s=max(0.01, deadline - time.monotonic()))
                    break
                except (AuthError, OSError) as err:
                    log.warning("channel liveness socket: refused %s: %s", peer, err)
                    conn.close()
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
