"""Why an instance cannot start, said in the error the launcher shows.

Two causes hide otherwise. A port the instance listens on is taken (another
cluster, or the last one's engine processes still exiting): checked before the
engine starts. And vLLM runs its engine core in a child process; when that dies
during start-up the parent raises only "Engine core initialization failed. See
root cause above.", where "above" is the Ray worker's log file, which a driver
started with log_to_driver=False never prints: the child's last exception line is
read back from that file.
"""

from __future__ import annotations

import os
import re
import socket
import stat
from dataclasses import dataclass

from pdcluster.proto.messages import Role
from pdcluster.proto.spec import ClusterSpec
from pdcluster.transfer.network import LOOPBACK


@dataclass(frozen=True)
class ListenPort:
    host: str
    port: int
    source: str  # the spec field the port comes from, so the error says what to change


def listen_ports(spec: ClusterSpec, role: Role, index: int, host: str = LOOPBACK) -> list[ListenPort]:
    """The fixed ports one instance binds on `host` (its bind address, transfer/network.py):
    its KV events (publish, replay) and its KV port (P's transfer server, or either role's
    NIXL side channel)."""
    pub, replay = spec.kv_event_ports(role, index)
    ports = [ListenPort(host, pub, "router.kv_events_port"), ListenPort(host, replay, "router.kv_events_port")]
    kv_port = spec.kv_port(role, index)
    if kv_port is not None:
        ports.append(ListenPort(host, kv_port, "transfer.base_port"))
    return ports


class PortInUse(RuntimeError):
    pass


def check_ports_free(ports: list[ListenPort]) -> None:
    """Raise PortInUse naming every port of `ports` that cannot be bound now."""
    busy = []
    for p in ports:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as ZMQ and gRPC bind
            try:
                s.bind((p.host, p.port))
            except OSError as err:
                busy.append(f"{p.host}:{p.port} ({p.source}: {err.strerror})")
    if busy:
        raise PortInUse(f"port(s) in use: {', '.join(busy)}; another cluster or a stopping one holds them: "
                        f"choose other ports or wait for it to exit")


# A Python exception line as a traceback ends: "zmq.error.ZMQError: Address already in use ...".
_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)\b(: .*)?$")
_ENGINE_CORE_DIED = "Process EngineCore"  # multiprocessing's header before the child's traceback


def engine_core_cause(log_text: str) -> str | None:
    """The last exception line the engine core process printed in `log_text`, if any."""
    start = log_text.rfind(_ENGINE_CORE_DIED)
    if start < 0:
        return None
    lines = [line.strip() for line in log_text[start:].splitlines()]
    found = [line for line in lines if _EXCEPTION_LINE.match(line)]
    return found[0] if found else None  # the child's own exception comes before the parent's


def own_stderr_tail(max_bytes: int = 256 * 1024) -> str:
    """The end of this process's stderr when it is a regular file (a Ray worker's log), else ""
    (a terminal or a pipe: reading those would block or steal another reader's bytes)."""
    try:
        if not stat.S_ISREG(os.fstat(2).st_mode):
            return ""
        with open(os.readlink("/proc/self/fd/2"), "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - max_bytes))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""
