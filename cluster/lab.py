"""The multi-host lab: one machine rehearsing N hosts with Linux network namespaces.

`Lab.up(hosts=2)` makes a bridge `<name>-br` holding the subnet's first address (the head, in the
root namespace) and per host k a namespace `<name>-host<k>` joined to it by a veth pair
(`<name>-h<k>` on the bridge, `<name>-h<k>ns` inside, with the subnet's (k+1)-th address); a Ray
head in the root namespace and a Ray worker node in each namespace, labelled `pdc-host=head|host<k>`
(pin an actor with `.options(label_selector={"pdc-host": "host1"})`). Faults: `set_link`,
`kill_host`, `revive_host`; `partition(a, b)` / `heal(a, b)` cut and restore the path between two
hosts only; `shape` puts tbf on both directions of a link (the tc part is cluster/lab_tc.py).
Needs root and iproute2.

Contracts:
- All is named from `name` and written to `<PDC_LAB_DIR or /tmp/pdc-lab>/<name>/state.json` before
  it is made: `Lab.down_by_name(name)` removes it from any process, after a partial `up` too, and
  nothing else (processes: by namespace, and the session of the `ray start --head` run here); a
  state file is trusted only in this user's own directory, with the plan's names (lab_state.py).
- No route leaves the lab (no default route in a namespace, no NAT, ip_forward untouched), so every
  lab process gets `VLLM_HOST_IP`: vLLM finds its IP by a UDP connect towards 8.8.8.8.
- Each Ray node has its own `--temp-dir`: a plain `ray.init()` elsewhere starts its own cluster.
  `ray.init(address="auto")` does join the lab (Ray finds any raylet on the machine by its command
  line), and `ray stop` kills the lab's nodes too.
- Shaping and partitions are recorded in the state file (`LabHost.rate`, `.partitioned_from`) and
  live in qdiscs on the veths: `down` removes them with the veths.
- Ray declares a vanished node dead after `partition_tolerance_s` (cluster/ray_settings.py; at most
  `failure_detection.bound_s`). A link down for longer ends that host's Ray node for good (its
  raylet exits once it hears): `revive_host` starts a new one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import ipaddress
import json
import os
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from pdcluster.cluster.lab_procs import (
    _kill_all,
    _link_exists,
    _netns_list,
    _netns_pids,
    _proc,
    _rss_kb,
    _session_pids,
)
from pdcluster.cluster.lab_ray import (  # noqa: F401
    LABEL_KEY,
    RayNode,
    ray_nodes,
    spawn_ray_starts,
    use_ray_token,
    wait_for_nodes,
)
from pdcluster.cluster.lab_state import DEFAULT_ROOT, check_lab_name, check_names, lab_root, private_dir

# LabError is defined in lab_tc (the lowest layer) and re-exported from here, where callers import it.
from pdcluster.cluster.lab_tc import LabError, LinkControl, tbf_args
from pdcluster.cluster.lab_tc import run as _run
from pdcluster.cluster.ray_settings import FailureDetection

HEAD_LABEL = "head"
IFNAMSIZ = 15  # the kernel's limit on an interface name
MAX_HOSTS = 16  # hosts a lab makes at most: each is a Ray node (raylet and its workers) on this one machine


@dataclass
class LabHost:
    """One rehearsed host: a namespace, its veth pair, its address and Ray label."""

    name: str  # "host1"
    index: int  # k, from 1
    netns: str
    address: str
    label: str  # the value of its Ray node's `pdc-host` label
    veth: str  # the end on the bridge (root namespace)
    peer: str  # the end inside the namespace, holding `address`
    temp_dir: str  # its Ray node's --temp-dir
    rate: str | None = None  # tbf on both ends; None: unshaped
    latency: str | None = None
    partitioned_from: list[str] = field(default_factory=list)  # hosts cut from this one (both ways)

    @property
    def selector(self) -> dict[str, str]:
        """The Ray `label_selector` that pins an actor to this host."""
        return {LABEL_KEY: self.label}


Host = str | int | LabHost  # see Lab.host


# ---- pure parts (the address plan and names are Lab.plan) ----

def find_overlaps(subnet: str, routes: list[dict], addrs: list[dict]) -> list[str]:
    """What overlaps `subnet`, from `ip -j -4 route show table all` and `ip -j -4 addr` output.
    Default routes are left out: every subnet is inside them."""
    net, found = ipaddress.IPv4Network(subnet), []
    for r in routes:
        try:
            dst = ipaddress.IPv4Network(r.get("dst", "default"), strict=False)
        except ValueError:  # "default", or a kind of route without a prefix
            continue
        if dst.prefixlen > 0 and dst.overlaps(net):
            found.append(f"route {r['dst']}" + (f" dev {r['dev']}" if r.get("dev") else ""))
    for link in addrs:
        for a in link.get("addr_info", []):
            if a.get("family") == "inet" and net.overlaps(ipaddress.IPv4Network(f"{a['local']}/{a['prefixlen']}",
                                                                                strict=False)):
                found.append(f"address {a['local']}/{a['prefixlen']} on {link.get('ifname', '?')}")
    return found


# ---- the machine ----

def _free_ports(n: int) -> list[int]:
    """n distinct ports free on every address (the sockets are held together so that they differ)."""
    socks = [socket.create_server(("", 0)) for _ in range(n)]
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


@dataclass
class Lab(LinkControl):
    """A lab's plan and, once up, its Ray address. Make one with `Lab.up`, find it with `Lab.attach`.
    Shaping and partitions (`shape`, `partition`, `heal`, `partitions`) are in LinkControl."""

    name: str
    subnet: str
    head_address: str
    bridge: str
    hosts: list[LabHost]
    state_dir: str
    ray_cpus_per_host: int = 2
    object_store_mb: int = 128
    ray_port: int | None = None
    head_sid: int | None = None  # the session of the `ray start --head` run here: the head's processes
    partition_tolerance_s: float = 30.0  # a host cut for less keeps its Ray node (cluster/ray_settings.py)

    @property
    def failure_detection(self) -> FailureDetection:
        return FailureDetection.tolerating(self.partition_tolerance_s)

    @classmethod
    def plan(cls, hosts: int = 2, name: str = "pdclab", subnet: str = "10.213.0.0/24",
             ray_cpus_per_host: int = 2, object_store_mb: int = 128, partition_tolerance_s: float = 30.0) -> Lab:
        """The lab `up` would make, with nothing made; LabError if the name or subnet cannot hold it."""
        check_lab_name(name)
        if not 1 <= hosts <= MAX_HOSTS:
            raise LabError(f"hosts: {hosts} (1 to {MAX_HOSTS}: each host is a Ray node of its own, ~0.5 GB and "
                           f"some CPU)")
        try:
            net = ipaddress.IPv4Network(subnet)
        except ValueError as err:
            raise LabError(f"subnet {subnet!r}: {err}") from None
        if net.num_addresses - 2 < hosts + 1:  # no network or broadcast address; the head takes one
            raise LabError(f"subnet {subnet} has {max(net.num_addresses - 2, 0)} addresses; "
                           f"{hosts} hosts need {hosts + 1}")
        state_dir = lab_root() / name
        lab = cls(name=name, subnet=subnet, head_address=str(net.network_address + 1), bridge=f"{name}-br",
                  hosts=[LabHost(name=f"host{k}", index=k, netns=f"{name}-host{k}", label=f"host{k}",
                                 address=str(net.network_address + 1 + k), veth=f"{name}-h{k}", peer=f"{name}-h{k}ns",
                                 temp_dir=str(state_dir / f"host{k}")) for k in range(1, hosts + 1)],
                  state_dir=str(state_dir), ray_cpus_per_host=ray_cpus_per_host, object_store_mb=object_store_mb,
                  partition_tolerance_s=partition_tolerance_s)
        for ifname in [lab.bridge] + [n for h in lab.hosts for n in (h.veth, h.peer)]:
            if len(ifname) > IFNAMSIZ:
                longest = IFNAMSIZ - len(lab.hosts[-1].peer) + len(name)
                raise LabError(f"interface name {ifname!r} is {len(ifname)} characters (max {IFNAMSIZ}): use a "
                               f"shorter lab name (at most {longest} characters for {hosts} hosts)")
        return lab

    @classmethod
    def up(cls, hosts: int = 2, name: str = "pdclab", subnet: str = "10.213.0.0/24", rate: str | None = None,
           latency: str | None = None, ray_cpus_per_host: int = 2, *, object_store_mb: int = 128,
           timeout_s: float = 60.0, partition_tolerance_s: float = 30.0) -> Lab:
        """Make the network, shape it if `rate` is given, start Ray on the head and on every host;
        return once Ray has every node alive. On any failure, remove what was made and raise."""
        lab = cls.plan(hosts, name, subnet, ray_cpus_per_host, object_store_mb, partition_tolerance_s)
        if latency is not None and rate is None:
            raise LabError("latency without rate: tbf shapes to a rate (its latency bounds the queue)")
        if rate is not None:
            tbf_args(rate, latency)  # a bad rate or latency fails before anything is made
        lab._check_free()
        private_dir(lab_root())
        os.mkdir(lab.state_dir, 0o700)
        lab._save()  # from here on, down() finds whatever exists of the plan
        try:
            lab._make_network()
            if rate is not None:
                lab.shape(None, rate, latency)
            use_ray_token()
            lab._start_head(timeout_s)
            lab._start_workers(lab.hosts, timeout_s)
            lab.wait_for_nodes({HEAD_LABEL: lab.head_address} | {h.label: h.address for h in lab.hosts}, timeout_s)
        except BaseException:
            lab.down()
            raise
        return lab

    @classmethod
    def attach(cls, name: str = "pdclab") -> Lab:
        """The lab `name`, from the state file `up` wrote (in any process)."""
        path = lab_root() / name / "state.json"
        try:
            private_dir(private_dir(lab_root(), create=False) / name, create=False)
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise LabError(f"no lab {name!r} ({path} not found; pdc lab up --name {name})") from None
        try:
            planned = dataclasses.asdict(cls.plan(len(data.get("hosts") or ()) or 1, name, str(data.get("subnet"))))
        except LabError as err:
            raise LabError(f"{path}: {err}") from None
        check_names(data, planned, path)
        return cls(**data | {"hosts": [LabHost(**h) for h in data["hosts"]]})

    @classmethod
    def down_by_name(cls, name: str = "pdclab") -> bool:
        """Remove the lab `name` if it has a state file; False if it had none."""
        if not (lab_root() / name / "state.json").exists():
            with contextlib.suppress(OSError, LabError):  # an up that died before writing it made nothing else
                private_dir(lab_root(), create=False)
                (lab_root() / name).rmdir()
            return False
        cls.attach(name).down()
        return True

    def __enter__(self) -> Lab:
        return self

    def __exit__(self, *exc) -> None:
        self.down()

    @property
    def ray_address(self) -> str:
        return f"{self.head_address}:{self.ray_port}"

    def host(self, host: Host) -> LabHost:
        """A host by name ("host1"), index (1 or "1") or itself."""
        for h in self.hosts:
            if host in (h, h.name, h.index, str(h.index)):
                return h
        raise LabError(f"no host {host!r} in lab {self.name!r} (hosts: {', '.join(h.name for h in self.hosts)})")

    def _save(self) -> None:
        path = Path(self.state_dir) / "state.json"
        path.with_suffix(".tmp").write_text(json.dumps(dataclasses.asdict(self), indent=1))
        path.with_suffix(".tmp").replace(path)  # atomic: another process never reads half a file

    def _check_free(self) -> None:
        if os.geteuid() != 0:
            raise LabError("the lab needs root (network namespaces, veth, tc)")
        if shutil.which("ip") is None or shutil.which("tc") is None:
            raise LabError("the lab needs iproute2 (ip, tc)")
        if (Path(self.state_dir).exists() or any(map(_link_exists, [self.bridge] + [h.veth for h in self.hosts]))
                or _netns_list() & {h.netns for h in self.hosts}):
            raise LabError(f"lab {self.name!r} is up, or was left half-made: pdc lab down --name {self.name}")
        routes = json.loads(_run(["ip", "-j", "-4", "route", "show", "table", "all"]).stdout or "[]")
        addrs = json.loads(_run(["ip", "-j", "-4", "addr"]).stdout or "[]")
        if found := find_overlaps(self.subnet, routes, addrs):
            raise LabError(f"subnet {self.subnet} overlaps this machine's {'; '.join(found)} (pass another --subnet)")

    # ---- network ----

    def _make_network(self) -> None:
        prefix = ipaddress.IPv4Network(self.subnet).prefixlen
        _run(["ip", "link", "add", self.bridge, "type", "bridge"])
        _run(["ip", "addr", "add", f"{self.head_address}/{prefix}", "dev", self.bridge])
        _run(["ip", "link", "set", self.bridge, "up"])
        for h in self.hosts:
            _run(["ip", "netns", "add", h.netns])
            _run(["ip", "link", "add", h.veth, "type", "veth", "peer", "name", h.peer, "netns", h.netns])
            _run(["ip", "link", "set", h.veth, "master", self.bridge, "up"])
            _run(["ip", "-n", h.netns, "addr", "add", f"{h.address}/{prefix}", "dev", h.peer])
            _run(["ip", "-n", h.netns, "link", "set", h.peer, "up"])
            _run(["ip", "-n", h.netns, "link", "set", "lo", "up"])

    def set_link(self, host: Host, up: bool) -> None:
        """Both ends of a host's link down (its packets vanish: no FIN, no RST reach anyone) or up."""
        h, state = self.host(host), "up" if up else "down"
        _run(["ip", "link", "set", h.veth, state])
        _run(["ip", "-n", h.netns, "link", "set", h.peer, state])

    # ---- processes ----

    def _env(self, address: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        return env | {"VLLM_HOST_IP": address, "RAY_AUTH_MODE": "token", "RAY_USAGE_STATS_ENABLED": "0"}

    def _ray_start(self, *args: str, temp_dir: str, label: str) -> list[str]:
        return [str(Path(sys.executable).parent / "ray"), "start", *args, f"--temp-dir={temp_dir}",
                f"--num-cpus={self.ray_cpus_per_host}", f"--object-store-memory={self.object_store_mb * 2**20}",
                "--labels", f"{LABEL_KEY}={label}", f"--node-name={label}", "--disable-usage-stats",
                "--include-log-monitor=false",  # nobody reads the logs live; a process less per node
                "--min-worker-port=0", "--max-worker-port=0"]  # OS-chosen: no clash with a local Ray's range

    def _spawn(self, nodes: dict[str, tuple[list[str], dict]], timeout_s: float) -> None:
        def spawned(what: str, pid: int) -> None:
            if what == HEAD_LABEL:  # saved at once: down() must find the head's session even if a start fails
                self.head_sid = pid
                self._save()
        spawn_ray_starts(nodes, Path(self.state_dir), timeout_s, spawned)

    def _start_head(self, timeout_s: float) -> None:
        self.ray_port, client, agent = _free_ports(3)
        argv = self._ray_start("--head", f"--node-ip-address={self.head_address}", f"--port={self.ray_port}",
                               "--include-dashboard=false", "--no-monitor",  # no autoscaler: the nodes are fixed
                               f"--ray-client-server-port={client}",  # Ray starts one whenever it can; not on 10001
                               f"--dashboard-agent-listen-port={agent}",  # not 52365, which a local Ray takes
                               self.failure_detection.ray_start_arg(),
                               temp_dir=str(Path(self.state_dir) / "head"), label=HEAD_LABEL)
        self._spawn({HEAD_LABEL: (argv, self._env(self.head_address))}, timeout_s)

    def _start_workers(self, hosts: list[LabHost], timeout_s: float) -> None:
        nodes = {}
        for h in hosts:
            argv = self._ray_start(f"--address={self.ray_address}", f"--node-ip-address={h.address}",
                                   temp_dir=h.temp_dir, label=h.label)
            nodes[h.name] = ["ip", "netns", "exec", h.netns, *argv], self._env(h.address)
        self._spawn(nodes, timeout_s)

    def exec(self, host: Host, argv: list[str], **popen_kwargs) -> subprocess.Popen:
        """Start `argv` inside a host's namespace, VLLM_HOST_IP set (in a given `env` too)."""
        h = self.host(host)
        env = dict(popen_kwargs.pop("env", None) or os.environ) | {"VLLM_HOST_IP": h.address}
        return subprocess.Popen(["ip", "netns", "exec", h.netns, *argv], env=env, **popen_kwargs)

    def host_pids(self, host: Host) -> list[int]:
        return _netns_pids(self.host(host).netns)

    def head_pids(self) -> list[int]:
        """The head's session, if it is provably ours (a member names our state dir): a session id
        reused after the head died is never touched."""
        pids = _session_pids(self.head_sid) if self.head_sid else []
        return pids if any(self.state_dir in _proc(p, "cmdline") for p in pids) else []

    def rss_mb(self, host: Host | None = None) -> float:
        """Resident memory of a host's processes (None: the head's), summed."""
        return sum(map(_rss_kb, self.head_pids() if host is None else self.host_pids(host))) / 1024

    def kill_host(self, host: Host) -> None:
        """Crash a host: the link goes down first (so nothing it held sends a FIN or RST), then every
        process in its namespace gets SIGKILL. Returns once none of them can act (one still exiting
        holds no socket and runs no code); Ray notices later."""
        h = self.host(host)
        self.set_link(h, False)
        _kill_all(lambda: _netns_pids(h.netns), reap=False)  # killed is enough: a dying process holds no socket

    def revive_host(self, host: Host, timeout_s: float = 60.0) -> None:
        """Link up and a new Ray worker node (same address and label); returns once Ray has it alive."""
        h = self.host(host)
        before = {n.node_id for n in self.ray_nodes() if n.label == h.label}
        self.set_link(h, True)
        self._start_workers([h], timeout_s)
        self.wait_for_nodes({h.label: h.address}, timeout_s, exclude=before)

    # ---- Ray's view ----

    def ray_nodes(self) -> list[RayNode]:
        """Every node Ray's GCS knows in this lab, dead ones included."""
        return ray_nodes(self.ray_address)

    def wait_for_nodes(self, want: dict[str, str], timeout_s: float = 60.0, exclude: set[str] = frozenset()) -> None:
        """Until each label -> address of `want` has a live node (not one of `exclude`)."""
        wait_for_nodes(self.ray_address, want, timeout_s, exclude, logs=self.state_dir)

    # ---- teardown ----

    def down(self) -> None:
        """Remove everything the lab made, and nothing else: its processes (by namespace, and the head's
        session), veths (their qdiscs go with them), namespaces, bridge, state dir. Idempotent."""
        netns, head = _netns_list(), bool(self.head_pids())  # head: proven ours once, then all its session
        _kill_all(lambda: [p for h in self.hosts if h.netns in netns for p in _netns_pids(h.netns)]
                  + (_session_pids(self.head_sid) if head else []), reap=True)
        for h in self.hosts:
            # One end deletes the pair. Explicitly: a deleted namespace can outlive its name a while,
            # and its end of the pair (so ours too) with it.
            if _link_exists(h.veth):
                _run(["ip", "link", "del", h.veth])
            if h.netns in netns:
                _run(["ip", "netns", "del", h.netns])
        if _link_exists(self.bridge):
            _run(["ip", "link", "del", self.bridge])
        shutil.rmtree(self.state_dir, ignore_errors=True)
        if str(lab_root()) == DEFAULT_ROOT:  # the default root is the lab's own: gone with its last lab
            with contextlib.suppress(OSError):
                Path(self.state_dir).parent.rmdir()
