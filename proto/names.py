"""What a cluster's Ray actors are called: the launcher names them (cluster/launch.py), and a
router that Ray restarted finds its peers by these names (router/server.py)."""

from __future__ import annotations

NAMESPACE = "pdcluster"
ROUTER = "router"


def actor_name(spec, instance: str) -> str:
    """`spec`: the cluster's ClusterSpec (proto/spec.py)."""
    return f"{spec.name}:{instance}"


def router_name(index: int) -> str:
    return ROUTER if index == 0 else f"{ROUTER}-{index}"


def is_router(instance: str) -> bool:
    return instance == ROUTER or instance.startswith(f"{ROUTER}-")
