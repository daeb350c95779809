"""The multi-host lab (cluster/lab.py): the pure parts without root, then one real lab (e2e).

The end-to-end part shares one 2-host lab for the module and checks, in order: Ray sees the head
and both hosts with their labels and addresses; a label-pinned actor runs on its host; a plain
ray.init() elsewhere does not join the lab; TCP between two hosts, a link down (a connect times
out: no RST) and up again; a killed host, then revived, gets the label-pinned actor back; and after
down() nothing of the lab is left (namespaces, links, qdiscs, processes), twice.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pdcluster.cluster.lab import (
    HEALTH_CHECK_BOUND_S,
    IFNAMSIZ,
    LABEL_KEY,
    Lab,
    LabError,
    find_overlaps,
)
from pdcluster.cluster.lab_cli import add_lab_commands
from pdcluster.cluster.lab_tc import rate_bits, tbf_args

# ---- pure parts ----


@pytest.fixture
def lab_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("PDC_LAB_DIR", str(tmp_path))
    return tmp_path


def test_address_plan(lab_dir):
    lab = Lab.plan(hosts=3, name="pdclab", subnet="10.213.0.0/24")
    assert lab.head_address == "10.213.0.1" and lab.bridge == "pdclab-br"
    assert [(h.name, h.address, h.label, h.netns) for h in lab.hosts] == [
        ("host1", "10.213.0.2", "host1", "pdclab-host1"),
        ("host2", "10.213.0.3", "host2", "pdclab-host2"),
        ("host3", "10.213.0.4", "host3", "pdclab-host3")]
    assert lab.state_dir == str(lab_dir / "pdclab")
    assert lab.hosts[0].temp_dir == str(lab_dir / "pdclab" / "host1")
    assert lab.hosts[1].selector == {LABEL_KEY: "host2"}
    assert lab.host("host2") is lab.host(2) is lab.host("2") is lab.hosts[1]
    with pytest.raises(LabError, match="no host 'host9'"):
        lab.host("host9")


def test_subnet_must_hold_head_and_hosts(lab_dir):
    small = Lab.plan(hosts=13, subnet="192.168.77.16/28")  # 14 usable: the head and 13 hosts
    assert small.head_address == "192.168.77.17" and small.hosts[-1].address == "192.168.77.30"
    with pytest.raises(LabError, match="14 hosts need 15"):
        Lab.plan(hosts=14, subnet="192.168.77.16/28")
    for bad in ("10.213.0.1/24", "fd00::/64", "nonsense"):
        with pytest.raises(LabError, match="subnet"):
            Lab.plan(subnet=bad)
    with pytest.raises(LabError, match="at least 1"):
        Lab.plan(hosts=0)


def test_interface_names_fit_the_kernel(lab_dir):
    lab = Lab.plan(hosts=99, name="abcdefghi")  # the longest name that fits 99 hosts
    names = [lab.bridge] + [n for h in lab.hosts for n in (h.veth, h.peer)]
    assert max(map(len, names)) == IFNAMSIZ == 15 and len(set(names)) == len(names)
    with pytest.raises(LabError, match=r"'abcdefghij-h10ns' is 16 characters \(max 15\).*at most 9 characters"):
        Lab.plan(hosts=99, name="abcdefghij")
    for bad in ("Lab", "my-lab", "1lab", ""):
        with pytest.raises(LabError, match="lab name"):
            Lab.plan(name=bad)


ROUTES = [  # as `ip -j -4 route show table all` prints them
    {"dst": "default", "gateway": "192.0.2.1", "dev": "eth0", "flags": []},
    {"dst": "192.0.2.0/24", "dev": "eth0", "protocol": "kernel", "scope": "link", "prefsrc": "192.0.2.2"},
    {"type": "local", "dst": "127.0.0.0/8", "dev": "lo", "table": "local"},
    {"type": "local", "dst": "192.0.2.2", "dev": "eth0", "table": "local"},
    {"type": "broadcast", "dst": "192.0.2.255", "dev": "eth0", "table": "local"},
]
ADDRS = [{"ifname": "lo", "addr_info": [{"family": "inet", "local": "127.0.0.1", "prefixlen": 8}]},
         {"ifname": "eth0", "addr_info": [{"family": "inet", "local": "192.0.2.2", "prefixlen": 24}]}]


def test_overlaps_from_routes_and_addresses():
    assert find_overlaps("10.213.0.0/24", ROUTES, ADDRS) == []  # the default route does not count
    assert find_overlaps("192.0.2.128/25", ROUTES, ADDRS) == [
        "route 192.0.2.0/24 dev eth0", "route 192.0.2.255 dev eth0", "address 192.0.2.2/24 on eth0"]
    assert find_overlaps("127.1.0.0/16", ROUTES, ADDRS) == ["route 127.0.0.0/8 dev lo", "address 127.0.0.1/8 on lo"]
    vpn = ROUTES + [{"dst": "10.0.0.0/8", "gateway": "192.0.2.9", "dev": "eth0"}]
    assert find_overlaps("10.213.0.0/24", vpn, ADDRS) == ["route 10.0.0.0/8 dev eth0"]
    lab_up = [{"ifname": "pdclab-br", "addr_info": [{"family": "inet", "local": "10.213.0.1", "prefixlen": 24}]}]
    assert find_overlaps("10.213.0.0/16", [], lab_up) == ["address 10.213.0.1/24 on pdclab-br"]


def test_rates_and_tbf_arguments():
    assert rate_bits("200mbit") == 200e6 and rate_bits("1Gbit") == 1e9 and rate_bits("10mbps") == 80e6
    assert rate_bits("1mibit") == 2**20 and rate_bits("5000") == 5000
    with pytest.raises(LabError, match="rate"):
        rate_bits("fast")
    assert tbf_args("200mbit", None) == ["tbf", "rate", "200mbit", "burst", "100000", "latency", "50ms"]
    assert tbf_args("1mbit", "10ms")[3:] == ["burst", "32768", "latency", "10ms"]  # at least 32 KiB
    with pytest.raises(LabError, match="latency"):
        tbf_args("1mbit", "soon")


def test_state_file_round_trip_and_down_without_one(lab_dir):
    lab = Lab.plan(hosts=2, name="rt")
    lab.ray_port, lab.head_sid, lab.hosts[1].rate = 6380, 1234, "100mbit"
    Path(lab.state_dir).mkdir()
    lab._save()
    assert Lab.attach("rt") == lab
    assert Lab.down_by_name("nolab") is False
    with pytest.raises(LabError, match="no lab 'nolab'"):
        Lab.attach("nolab")


def test_cli(lab_dir, capsys):
    ap = argparse.ArgumentParser(prog="pdc")
    add_lab_commands(ap.add_subparsers(dest="cmd", required=True))
    a = ap.parse_args(["lab", "up", "--hosts", "4", "--rate", "200mbit", "--name", "x"])
    assert (a.hosts, a.rate, a.latency, a.name, a.subnet) == (4, "200mbit", None, "x", "10.213.0.0/24")
    assert ap.parse_args(["lab", "exec", "host1", "--", "ls", "-l"]).cmd == ["ls", "-l"]
    assert ap.parse_args(["lab", "link", "host2", "down"]).state == "down"
    from pdcluster.cluster.cli import main  # the hook in `pdc`

    with pytest.raises(SystemExit) as err:
        main(["lab", "status", "--name", "nolab"])
    assert err.value.code == 2 and "no lab 'nolab'" in capsys.readouterr().err
    main(["lab", "down", "--name", "nolab"])  # idempotent: nothing to do is fine
    assert "nothing to do" in capsys.readouterr().out


# ---- end to end: one real lab ----

E2E_NAME, E2E_SUBNET = "pdctest", "10.213.97.0/24"
needs_root = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None,
                                reason="the lab needs root and iproute2")


def _sh(*argv: str) -> str:
    return subprocess.run(argv, capture_output=True, text=True, check=True).stdout


def _starttime(pid: str) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _cmdlines() -> list[str]:
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            out.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
        except OSError:
            pass  # gone meanwhile
    return out


def snapshot() -> dict:
    """What the machine has: namespaces, links and qdiscs of the root namespace, processes."""
    return {"netns": {line.split()[0] for line in _sh("ip", "netns", "list").splitlines()},
            "links": {line.split()[0].split("@")[0] for line in _sh("ip", "-br", "link").splitlines()},
            "qdiscs": {re.sub(r" refcnt \d+", "", line) for line in _sh("tc", "qdisc", "show").splitlines()},
            "procs": {(p, _starttime(p)) for p in os.listdir("/proc") if p.isdigit()}}


def lab_leftovers(before: dict, lab: Lab, netns_inodes: set[int]) -> dict:
    """What is on the machine now that was not before and belongs to the lab: any namespace, link
    or qdisc that is new, and any new process in the lab's namespaces (even unnamed ones), in its
    head's session, or naming its state dir or subnet. Found by reading /proc, not by asking lab.py."""
    now = snapshot()
    procs = []
    for pid, _ in now["procs"] - before["procs"]:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            inode = os.stat(f"/proc/{pid}/ns/net").st_ino
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue  # gone meanwhile
        if stat[0] != "Z" and (inode in netns_inodes or int(stat[3]) == lab.head_sid
                               or lab.state_dir in cmd or lab.subnet.rsplit(".", 1)[0] + "." in cmd):
            procs.append(f"{pid} {cmd[:120]}")
    out = {k: sorted(now[k] - before[k]) for k in ("netns", "links", "qdiscs")} | {"procs": procs}
    if Path(lab.state_dir).exists():
        out["state_dir"] = [lab.state_dir]
    return {k: v for k, v in out.items() if v}


def netns_inodes(lab: Lab) -> set[int]:
    return {os.stat(f"/run/netns/{h.netns}").st_ino for h in lab.hosts}


@pytest.fixture(scope="module")
def before():
    return snapshot()


@pytest.fixture(scope="module")
def lab(before):
    lab = Lab.up(hosts=2, name=E2E_NAME, subnet=E2E_SUBNET)
    lab.test_inodes = netns_inodes(lab)  # for the leak check, read before down() removes the names
    yield lab
    import ray

    ray.shutdown()  # a driver whose GCS vanishes exits its process after a while: never ours
    lab.down()


@pytest.fixture(scope="module")
def driver(lab):
    import ray

    ray.init(address=lab.ray_address, namespace="pdc-lab-test", log_to_driver=False)
    yield ray
    ray.shutdown()


def where_actor(ray, **options):
    """An actor reporting where it runs (defined here, so Ray ships it by value)."""
    class Where:
        def where(self) -> tuple[str, str | None, int]:
            return ray.util.get_node_ip_address(), os.environ.get("VLLM_HOST_IP"), os.getpid()

    return ray.remote(num_cpus=0, **options)(Where)


@pytest.mark.e2e
@needs_root
def test_ray_sees_head_and_hosts_with_labels(lab, driver):
    alive = {(n.label, n.address) for n in lab.ray_nodes() if n.alive}
    assert alive == {("head", lab.head_address), ("host1", lab.hosts[0].address), ("host2", lab.hosts[1].address)}
    from_driver = {(n["Labels"].get(LABEL_KEY), n["NodeManagerAddress"]) for n in driver.nodes() if n["Alive"]}
    assert from_driver == alive
    assert lab.ray_address.startswith(lab.head_address + ":")


@pytest.mark.e2e
@needs_root
def test_actor_pinned_by_label_runs_on_its_host(lab, driver):
    Where = where_actor(driver)
    for host in lab.hosts:
        ip, vllm_ip, _ = driver.get(Where.options(label_selector=host.selector).remote().where.remote(), timeout=60)
        assert ip == vllm_ip == host.address
    ip, vllm_ip, _ = driver.get(Where.options(label_selector={LABEL_KEY: "head"}).remote().where.remote(), timeout=60)
    assert ip == vllm_ip == lab.head_address


PLAIN_INIT = """
import json, ray
ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
w = ray._private.worker.global_worker
print(json.dumps({"gcs": w.gcs_client.address, "nodes": [n["NodeManagerAddress"] for n in ray.nodes()],
                  "session": w.node.get_session_dir_path()}))
ray.shutdown()
"""


@pytest.mark.e2e
@needs_root
def test_plain_ray_init_elsewhere_starts_its_own_cluster(lab, tmp_path):
    default_file = Path("/tmp/ray/ray_current_cluster")  # what a plain ray.init() reads first
    assert not (default_file.exists() and default_file.read_text().strip() == lab.ray_address)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"HOME": str(tmp_path)}  # its token there
    out = subprocess.run([sys.executable, "-c", PLAIN_INIT], capture_output=True, text=True, env=env,
                         cwd=tmp_path, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    session = Path(got["session"])
    if session.parent == Path("/tmp/ray") and session.name.startswith("session_"):  # ours: remove it
        deadline = time.monotonic() + 15  # once its processes are gone, or one would write it again
        while time.monotonic() < deadline and any(str(session) in cmd for cmd in _cmdlines()):
            time.sleep(0.2)
        shutil.rmtree(session, ignore_errors=True)
        latest = session.parent / "session_latest"
        if latest.is_symlink() and os.readlink(latest) == str(session):
            latest.unlink()
        try:
            session.parent.rmdir()  # only if nothing else is there
        except OSError:
            pass
    prefix = lab.subnet.rsplit(".", 1)[0] + "."
    assert got["gcs"] != lab.ray_address and not got["gcs"].startswith(prefix)
    assert got["nodes"] and not any(ip.startswith(prefix) for ip in got["nodes"])


SERVER = """
import socket, sys
srv = socket.create_server(("0.0.0.0", int(sys.argv[1])))
print("ready", flush=True)
while True:
    srv.accept()[0].close()
"""
CONNECT = """
import socket, sys
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3])).close()
    print("ok")
except TimeoutError:
    print("timeout")
except OSError as err:
    print(f"error {err.errno} {err.strerror}")
"""


def _connect(lab: Lab, src: str, dst: str, port: int = 7001, timeout_s: float = 1.0) -> str:
    p = lab.exec(src, [sys.executable, "-c", CONNECT, lab.host(dst).address, str(port), str(timeout_s)],
                 stdout=subprocess.PIPE, text=True)
    return p.communicate(timeout=30)[0].strip()


@pytest.mark.e2e
@needs_root
def test_tcp_between_hosts_and_a_link_down_that_drops_silently(lab, driver):
    server = lab.exec("host2", [sys.executable, "-c", SERVER, "7001"], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline().strip() == "ready"
        assert _connect(lab, "host1", "host2") == "ok"
        lab.set_link("host2", False)
        try:
            assert _connect(lab, "host1", "host2") == "timeout"  # no RST, no refusal: packets just vanish
        finally:
            lab.set_link("host2", True)
        deadline = time.monotonic() + 10
        while (result := _connect(lab, "host1", "host2")) != "ok" and time.monotonic() < deadline:
            time.sleep(0.1)
        assert result == "ok"
    finally:
        server.kill()
        server.wait()
    # The link was down for less than Ray's health-check bound: host2's node lived through it.
    assert [n.alive for n in lab.ray_nodes() if n.label == "host2"] == [True]


@pytest.mark.e2e
@needs_root
def test_killed_host_revived_gets_its_pinned_actor_back(lab, driver):
    host = lab.host("host1")
    actor = where_actor(driver, max_restarts=-1).options(label_selector=host.selector).remote()
    ip, _, pid = driver.get(actor.where.remote(), timeout=60)
    assert ip == host.address
    [old] = [n.node_id for n in lab.ray_nodes() if n.label == host.label and n.alive]
    lab.kill_host(host)
    assert lab.host_pids(host) == []
    deadline = time.monotonic() + HEALTH_CHECK_BOUND_S + 20  # a generous bound: this is not a timing test
    while any(n.alive for n in lab.ray_nodes() if n.node_id == old) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [n.alive for n in lab.ray_nodes() if n.node_id == old] == [False]
    lab.revive_host(host)
    [new] = [n for n in lab.ray_nodes() if n.label == host.label and n.alive]
    assert new.node_id != old and new.address == host.address
    ip, vllm_ip, new_pid = driver.get(actor.where.remote(), timeout=60)
    assert ip == vllm_ip == host.address and new_pid != pid


CRASH_HALF_WAY = """
import os, sys
from pdcluster.cluster.lab import Lab
Lab._start_workers = lambda self, hosts, timeout_s: os._exit(3)  # dies with the network and the head made
Lab.up(hosts=2, name=sys.argv[1], subnet=sys.argv[2])
"""


@pytest.mark.e2e
@needs_root
def test_refusals_and_down_after_a_half_made_up(lab):
    with pytest.raises(LabError, match=f"lab '{E2E_NAME}' is up"):
        Lab.up(name=E2E_NAME, subnet="10.213.98.0/24")
    with pytest.raises(LabError, match=f"overlaps this machine's .*route {E2E_SUBNET} dev {E2E_NAME}-br"):
        Lab.up(name="pdcother", subnet="10.213.0.0/16")
    assert not Path(Lab.plan(name="pdcother").state_dir).exists()  # a refusal makes nothing

    before = snapshot()
    real = Lab._ray_start

    def head_fails(self, *args, temp_dir, label):
        return ["false"] if label == "head" else real(self, *args, temp_dir=temp_dir, label=label)

    with pytest.MonkeyPatch.context() as mp, pytest.raises(LabError, match="ray start on head failed"):
        mp.setattr(Lab, "_ray_start", head_fails)
        Lab.up(hosts=2, name="pdchalf", subnet="10.213.98.0/24")  # fails in this process: removes what it made
    assert lab_leftovers(before, Lab.plan(name="pdchalf", subnet="10.213.98.0/24"), set()) == {}

    out = subprocess.run([sys.executable, "-c", CRASH_HALF_WAY, "pdchalf", "10.213.98.0/24"], timeout=120)
    assert out.returncode == 3  # a process that died half way: its state file tells down() what exists
    half = Lab.attach("pdchalf")
    inodes = netns_inodes(half)
    assert half.head_sid and half.head_pids() and lab_leftovers(before, half, inodes).keys() >= {"netns", "procs"}
    assert Lab.down_by_name("pdchalf")
    assert lab_leftovers(before, half, inodes) == {}


@pytest.mark.e2e
@needs_root
def test_down_leaves_nothing_and_a_second_cycle_works(lab, before):
    import ray

    ray.shutdown()
    seen = lab_leftovers(before, lab, set())  # the check sees a lab that is up
    assert seen.keys() == {"netns", "links", "qdiscs", "procs", "state_dir"}, seen
    lab.down()
    assert lab_leftovers(before, lab, lab.test_inodes) == {}
    lab.down()  # idempotent
    again = Lab.up(hosts=2, name=E2E_NAME, subnet=E2E_SUBNET, rate="200mbit", latency="20ms")
    inodes = netns_inodes(again)
    try:
        h1 = again.host("host1")
        assert "tbf" in _sh("tc", "qdisc", "show", "dev", h1.veth)
        assert "rate 200Mbit" in _sh("tc", "-n", h1.netns, "qdisc", "show", "dev", h1.peer)
        again.shape("host1", None)
        assert "tbf" not in _sh("tc", "qdisc", "show", "dev", h1.veth)
        assert Lab.attach(E2E_NAME).host("host2").rate == "200mbit" and Lab.attach(E2E_NAME).host(1).rate is None
        assert {n.label for n in again.ray_nodes() if n.alive} == {"head", "host1", "host2"}
    finally:
        assert Lab.down_by_name(E2E_NAME)  # from the state file, as `pdc lab down` does
    assert lab_leftovers(before, again, inodes) == {}
