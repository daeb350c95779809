"""Where a cluster's actors go: Ray scheduling options from the spec's `placement:` fields,
checked against the nodes Ray has before anything starts.

An instance is pinned by Ray node labels (`label_selector`, whose values may be `v`, `!v`,
`in(a, b)` or `!in(a, b)`), never by node id: when its
host dies, Ray restarts it (max_restarts=-1) on whichever node carries the same labels,
so a host that rejoins gets its instances back. Routers go to the node `pdc up` runs on
(its URL is then that host's), or to a node with `router.labels`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pdcluster.proto.messages import Role
from pdcluster.proto.spec import ClusterSpec


class PlacementError(ValueError):
    """A spec asks for a node Ray does not have; the message names the field."""


@dataclass(frozen=True)
class NodeView:
    """What placement needs of one Ray node."""

    node_id: str
    ip: str
    labels: dict[str, str]


def alive_nodes() -> list[NodeView]:
    import ray

    return [NodeView(n["NodeID"], n["NodeManagerAddress"], dict(n.get("Labels") or {}))
            for n in ray.nodes() if n.get("Alive")]


def selects(value: str | None, selector: str) -> bool:
    """Whether a node's label value (None: the node has no such label) satisfies one value of
    a Ray label selector: `v`, `!v`, `in(a, b)` or `!in(a, b)`."""
    negated = selector.startswith("!")
    body = selector[1:] if negated else selector
    if body.startswith("in(") and body.endswith(")"):
        hit = value in body[3:-1].split(",")  # as Ray splits: the spec drops spaces after commas
    else:
        hit = value == body
    return hit != negated


def _matching(nodes: list[NodeView], labels: dict[str, str]) -> list[NodeView]:
    return [n for n in nodes if all(selects(n.labels.get(k), v) for k, v in labels.items())]


def _describe(nodes: list[NodeView]) -> str:
    def own(labels: dict[str, str]) -> str:
        mine = {k: v for k, v in sorted(labels.items()) if not k.startswith("ray.io/")}
        return "{" + ", ".join(f"{k}: {v}" for k, v in mine.items()) + "}"

    return "; ".join(f"{n.ip} {own(n.labels)}" for n in nodes) or "none"


def check_placement(spec: ClusterSpec, nodes: list[NodeView]) -> None:
    """Every instance (and the routers) can go somewhere now; else PlacementError naming
    the field and the nodes Ray has."""
    for role in ("prefill", "decode"):
        placement = getattr(spec, role).placement
        for index in range(getattr(spec, role).instances):
            wanted = placement.labels_of(index)
            if wanted and not _matching(nodes, wanted):
                field = (f"{role}.placement.per_instance[{index}]" if placement.per_instance
                         and placement.per_instance[index] else f"{role}.placement.labels")
                raise PlacementError(f"{field}: no Ray node has labels {wanted} ({role}-{index}); "
                                     f"the nodes: {_describe(nodes)}")
    if spec.router.labels and not _matching(nodes, spec.router.labels):
        raise PlacementError(f"router.labels: no Ray node has labels {spec.router.labels}; "
                             f"the nodes: {_describe(nodes)}")


def engine_options(spec: ClusterSpec, role: Role, index: int) -> dict[str, Any]:
    """Ray actor options placing one instance (merged into its other options)."""
    placement = getattr(spec, role).placement
    opts: dict[str, Any] = {}
    wanted = placement.labels_of(index)
    if wanted:
        opts["label_selector"] = dict(wanted)
    if placement.spread:
        opts["scheduling_strategy"] = "SPREAD"
    return opts


def router_options(spec: ClusterSpec, driver_node_id: str | None) -> dict[str, Any]:
    """Router 0's placement: a node with router.labels, else the driver's node (None: anywhere,
    for a driver that is not on a Ray node)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    if spec.router.labels:
        return {"label_selector": dict(spec.router.labels)}
    if driver_node_id is None:
        return {}
    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(driver_node_id, soft=False)}
