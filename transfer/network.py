"""Which address an instance's planes bind, and which one it tells its peers.

Every plane an instance serves (the request channel, P's gRPC KV service and the
torch.distributed channel store inside it, the KV-event publisher and its replay
socket) binds one address of its node and advertises exactly that address in its
InstanceInfo, so the router and the other instances dial what was bound:

- `network.mode: loopback`: 127.0.0.1. What `auto` gives a Ray cluster of one node.
- `network.mode: node`: the node's own address: the one on `network.interface`, or the
  one inside `network.cidr` (a host with a fast RDMA/RoCE network beside the management
  one), else the node's Ray IP. What `auto` gives a Ray cluster of several nodes.
- `network.bind_all: true` binds 0.0.0.0 instead, still advertising the chosen address:
  the only way anything binds a wildcard address, and only when a spec asks.

`auto` is settled by the launcher from the Ray nodes alive at `pdc up`
(`settle_mode`); an instance restarted later binds as its cluster was started.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

LOOPBACK = "127.0.0.1"
WILDCARD = "0.0.0.0"

Mode = Literal["auto", "loopback", "node"]


class AddressError(ValueError):
    """No address of this node fits the spec's `network:`; the message names the field."""


@dataclass(frozen=True)
class InstanceAddress:
    bind: str  # what the planes' sockets bind
    advertise: str  # what peers are told to dial (== bind unless bind_all)


def settle_mode(mode: Mode, interface: str | None, cidr: str | None, alive_nodes: int) -> Literal["loopback", "node"]:
    """`auto` as the cluster starts: one node keeps to loopback, several need the node's address
    (as does naming an interface or a network)."""
    if mode != "auto":
        return mode
    return "node" if interface or cidr or alive_nodes > 1 else "loopback"


def choose_address(mode: Literal["loopback", "node"], node_ip: str, interfaces: Mapping[str, Sequence[str]], *,
                   interface: str | None = None, cidr: str | None = None, bind_all: bool = False) -> InstanceAddress:
    """The address of one instance on its node. `interfaces`: this node's IPv4 addresses by
    interface name (`local_interfaces()`); `node_ip`: its Ray node IP."""
    assert mode in ("loopback", "node"), f"network mode {mode!r} must be settled (settle_mode) before choosing"
    if mode == "loopback":
        chosen = LOOPBACK
    elif interface is not None:
        addrs = list(interfaces.get(interface, ()))
        if not addrs:
            have = ", ".join(f"{n} ({', '.join(a) or 'no IPv4'})" for n, a in sorted(interfaces.items()))
            why = "has no IPv4 address" if interface in interfaces else "does not exist"
            raise AddressError(f"network.interface: {interface!r} {why} on node {node_ip} (it has: {have})")
        chosen = addrs[0]
    elif cidr is not None:
        net = ipaddress.ip_network(cidr, strict=False)
        inside = sorted((a for addrs in interfaces.values() for a in addrs if ipaddress.ip_address(a) in net),
                        key=ipaddress.ip_address)
        if not inside:
            have = ", ".join(sorted(a for addrs in interfaces.values() for a in addrs))
            raise AddressError(f"network.cidr: node {node_ip} has no address in {net} (it has: {have})")
        chosen = inside[0]
    else:
        chosen = node_ip
    return InstanceAddress(WILDCARD if bind_all else chosen, chosen)


def local_interfaces() -> dict[str, list[str]]:
    """This host's IPv4 addresses by interface name."""
    import socket

    import psutil

    return {name: [a.address for a in addrs if a.family == socket.AF_INET]
            for name, addrs in psutil.net_if_addrs().items()}


def instance_address(network, node_ip: str) -> InstanceAddress:
    """`choose_address` for the node this process runs on, from a spec's settled `network:`."""
    return choose_address(network.mode, node_ip, local_interfaces(), interface=network.interface,
                          cidr=network.cidr, bind_all=network.bind_all)


def host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


LOOPBACK_ADDRESS = InstanceAddress(LOOPBACK, LOOPBACK)


def instance_planes(address: InstanceAddress, request_channel: str, kv_event_ports: tuple[int, int]):
    """An instance's PlaneAddresses: its request channel (bound already) and its KV-event
    sockets (publish, replay ports from the spec), all at its advertised address."""
    from pdcluster.proto.messages import PlaneAddresses

    pub, replay = kv_event_ports
    return PlaneAddresses(address.advertise, request_channel, f"tcp://{host_port(address.advertise, pub)}",
                          f"tcp://{host_port(address.advertise, replay)}")
