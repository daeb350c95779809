"""Free local ports for a cluster started by a test or a bench beside other clusters."""

from __future__ import annotations

import random
import socket


def free_port_run(n: int) -> int:
    """A base port with n free consecutive ports from it (KV-event ports: two per instance)."""
    rng = random.Random()
    for _ in range(50):
        # Above Ray's worker ports (10002-19999), below Linux's ephemeral ones (32768 on),
        # so no outgoing connection takes one between this check and the engine's bind.
        base = rng.randrange(20000, 32768 - n)
        socks = []
        try:
            for port in range(base, base + n):
                socks.append(socket.socket())
                socks[-1].bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no run of {n} free ports found")


def on_free_ports(spec):
    """A ClusterSpec moved to free ports: its KV ports, KV-event ports and router port."""
    n = spec.prefill.instances + spec.decode.instances
    base = free_port_run(3 * n + 1)
    return spec.model_copy(update={
        "transfer": spec.transfer.model_copy(update={"base_port": base}),
        "router": spec.router.model_copy(update={"kv_events_port": base + n, "port": base + 3 * n})})
