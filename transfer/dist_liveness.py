"""Knowing a torch.distributed pair's peer is gone (transfer/dist_channel.py): a plain TCP
connection beside the process group, proven with the cluster secret, with keepalives, whose only
job is to close when the peer dies; a thread watches it and says why."""

from __future__ import annotations

import queue
import select
import socket
import threading
import time

import torch.distributed as dist

# The liveness connection: its peer's host vanishing (no FIN) ends it within ~11 s.
_KEEPALIVE = ((socket.SO_KEEPALIVE, 1, socket.SOL_SOCKET), (socket.TCP_KEEPIDLE, 5, socket.IPPROTO_TCP),
              (socket.TCP_KEEPINTVL, 2, socket.IPPROTO_TCP), (socket.TCP_KEEPCNT, 3, socket.IPPROTO_TCP))


MAX_PENDING = 16  # connections P handshakes at once while it waits for D's


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
    """The first connection to prove the key. Each is handshaked in a thread of its own (at most
    MAX_PENDING at once, each within HANDSHAKE_TIMEOUT_S), so a silent or wrong peer never holds
    up D's (one silent connection used to take the whole open deadline)."""
    from pdcluster.transfer.auth import HANDSHAKE_TIMEOUT_S, AuthError, Refusals, handshake_socket

    proven: queue.Queue[socket.socket] = queue.Queue()
    pending = threading.BoundedSemaphore(MAX_PENDING)
    done = threading.Event()
    refusals = Refusals("channel liveness socket", "connection(s)")

    def prove(conn: socket.socket, peer) -> None:
        try:
            handshake_socket(conn, auth_key, server=True,
                             timeout_s=max(0.01, min(HANDSHAKE_TIMEOUT_S, deadline - time.monotonic())))
            if done.is_set():  # another proved itself first
                conn.close()
            else:
                proven.put(conn)
        except (AuthError, OSError) as err:
            refusals.refused(str(peer), err)
            conn.close()
        finally:
            pending.release()

    try:
        while True:
            try:
                return proven.get_nowait()
            except queue.Empty:
                pass
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError("D never connected its liveness socket")
            if not select.select([listener], [], [], min(remaining, 0.02))[0]:
                continue
            conn, peer = listener.accept()
            if pending.acquire(blocking=False):
                threading.Thread(target=prove, args=(conn, peer), daemon=True, name="pdc-liveness-handshake").start()
            else:
                conn.close()
    finally:
        done.set()
        while not proven.empty():  # proven after the first was taken (none from a D: it connects once)
            proven.get_nowait().close()


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
