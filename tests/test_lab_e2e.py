"""The multi-host lab (cluster/lab.py, lab_tc.py) end to end, on one real lab (the pure parts: test_lab.py).

The end-to-end part shares one 3-host lab for the module and checks, in order: Ray sees the head
and the hosts with their labels and addresses; a label-pinned actor runs on its host; a plain
ray.init() elsewhere does not join the lab; TCP between two hosts, a link down (a connect times
out: no RST) and up again; a partition between two hosts (silent both ways, every other path up,
an established connection stalls and resumes after heal); partitions and shaping composed, from
the CLI too; a killed host, then revived, gets the label-pinned actor back; and after down()
nothing of the lab is left (namespaces, links, qdiscs, processes), twice.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from e2e import wait_until
from lab_agents import _connect, _rate_mbit, _until

from pdcluster.cluster.lab import (
    LABEL_KEY,
    Lab,
    LabError,
)

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
    # A short tolerance: the kill test waits for Ray to declare a host dead.
    lab = Lab.up(hosts=3, name=E2E_NAME, subnet=E2E_SUBNET, partition_tolerance_s=3.0)
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
    assert alive == {("head", lab.head_address)} | {(h.label, h.address) for h in lab.hosts} and len(alive) == 4
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


@pytest.mark.e2e
@needs_root
def test_tcp_between_hosts_and_a_link_down_that_drops_silently(lab, driver, agents):
    assert _connect(agents, "host1", "host2") == "ok"
    lab.set_link("host2", False)
    try:
        assert _connect(agents, "host1", "host2") == "timeout"  # no RST, no refusal: packets just vanish
    finally:
        lab.set_link("host2", True)
    _until(lambda: _connect(agents, "host1", "host2") == "ok")
    # The link was down for less than Ray's health-check bound: host2's node lived through it.
    assert [n.alive for n in lab.ray_nodes() if n.label == "host2"] == [True]


@pytest.mark.e2e
@needs_root
def test_partition_cuts_one_path_silently_and_heal_restores_it(lab, driver, agents):
    a, b, c = agents["host1"], agents["host2"], agents["host3"]
    assert a.ask(f"open {b.address} {b.port}") == "ok" and a.ask("send 1000000 10") == "1000000"
    _until(lambda: b.ask("received") == "1000000 open")
    t0 = time.monotonic()
    lab.partition("host1", "host2")
    cut_s = time.monotonic() - t0
    assert Lab.attach(E2E_NAME).partitions == [("host1", "host2")]
    # Both ways and silently: a connect times out (no RST, refusal or unreachable), datagrams vanish
    # and their senders see no error, even with IP_RECVERR (host3's, the control, arrive).
    assert _connect(agents, "host1", "host2") == _connect(agents, "host2", "host1") == "timeout"
    for x, y in ((a, b), (b, a), (c, b), (c, a)):
        assert x.ask(f"udp {y.address} {y.port} 3") == "sent 0"
    _until(lambda: a.ask("udp_received") == b.ask("udp_received") == "3")
    # Every other path is up: the head (the router) reaches both and they reach it, and a third host.
    for x, y in [("head", "host1"), ("head", "host2"), ("host1", "head"), ("host2", "head"),
                 ("host1", "host3"), ("host3", "host1"), ("host2", "host3"), ("host3", "host2")]:
        assert _connect(agents, x, y) == "ok", (x, y)
    for host in ("host1", "host2"):  # Ray's too: the head still runs actors on both
        ip, _, _ = driver.get(where_actor(driver).options(label_selector=lab.host(host).selector).remote()
                              .where.remote(), timeout=60)
        assert ip == lab.host(host).address
    # The established connection: writes stall (the send buffer fills), the reader gets nothing, no reset.
    sent = int(a.ask("send 8000000 2"))
    outq, err = map(int, a.ask("state").split())
    assert sent < 8000000 and outq > 0 and err == 0 and b.ask("received") == "1000000 open"
    t0 = time.monotonic()
    lab.heal("host1", "host2")
    heal_s = time.monotonic() - t0
    assert _connect(agents, "host1", "host2") == _connect(agents, "host2", "host1") == "ok"
    resume_s = _until(lambda: int(b.ask("received").split()[0]) > 1000000, 30)  # at its next retransmission
    assert int(a.ask(f"send {8000000 - sent} 30")) == 8000000 - sent
    _until(lambda: b.ask("received") == "9000000 open" and a.ask("state") == "0 0", 30)
    print(f"partition applied in {cut_s * 1e3:.0f} ms, healed in {heal_s * 1e3:.0f} ms; the stalled "
          f"connection resumed {resume_s:.2f} s after heal ({sent} of 8000000 bytes taken while cut)")


@pytest.mark.e2e
@needs_root
def test_partitions_and_shaping_compose(lab, agents, capsys):
    from pdcluster.cluster.cli import main

    veth = lab.host("host1").veth
    def tree() -> str:  # noqa: E306
        return _sh("tc", "qdisc", "show", "dev", veth) + _sh("tc", "filter", "show", "dev", veth)

    lab.shape("host1", "50mbit")
    main(["lab", "partition", "host1", "host2", "--name", E2E_NAME])  # the CLI, on the state file: `lab` is stale
    main(["lab", "partition", "3", "1", "--name", E2E_NAME])
    main(["lab", "status", "--name", E2E_NAME])
    out = capsys.readouterr().out
    assert "host1 <-> host2: cut" in out and "partitions: host1 <-> host2, host1 <-> host3" in out, out
    assert "tbf 50mbit" in out and re.search(r"tbf 10: parent 1:10 rate 50Mbit", tree())
    lab.shape("host1", "20mbit", "20ms")  # reshape while partitioned
    assert "rate 20Mbit" in tree() and tree().count("flowid 1:20") == 2
    assert _connect(agents, "host1", "host2") == _connect(agents, "host3", "host1") == "timeout"
    assert 10 < (mbit := _rate_mbit(agents, "head", "host1")) < 25, mbit  # shaped, not cut
    print(f"head -> host1 at 20mbit through the partition tree: {mbit:.1f} Mbit/s")
    lab.heal("host2", "host1")
    assert _connect(agents, "host1", "host2") == "ok" and _connect(agents, "host1", "host3") == "timeout"
    lab.shape("host1", None)  # unshape while partitioned
    assert "tbf" not in tree() and tree().count("flowid 1:20") == 1
    assert _connect(agents, "host3", "host1") == "timeout" and _connect(agents, "host2", "host1") == "ok"
    main(["lab", "heal", "host1", "host3", "--name", E2E_NAME])
    assert "htb" not in tree() and "filter" not in tree()  # nothing of ours left on the link
    assert _connect(agents, "host3", "host1") == "ok" and Lab.attach(E2E_NAME).partitions == []


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
    # A generous bound: this is not a timing test.
    wait_until(lambda: [n.alive for n in lab.ray_nodes() if n.node_id == old] == [False], lab.failure_detection.bound_s + 20,
               interval=0.1, what="Ray declaring the killed host's node dead")
    lab.revive_host(host)
    [new] = [n for n in lab.ray_nodes() if n.label == host.label and n.alive]
    assert new.node_id != old and new.address == host.address
    # Retried: a call that reaches the actor while it is still restarting fails (ActorUnavailableError).
    ip, vllm_ip, new_pid = driver.get(actor.where.options(max_task_retries=-1).remote(), timeout=60)
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
        again.partition("host1", "host2")  # left for down(): a shaped end and a plain one, both with filters
        assert "htb" in _sh("tc", "qdisc", "show", "dev", h1.veth) and Lab.attach(E2E_NAME).partitions
        assert {n.label for n in again.ray_nodes() if n.alive} == {"head", "host1", "host2"}
    finally:
        assert Lab.down_by_name(E2E_NAME)  # from the state file, as `pdc lab down` does
    assert lab_leftovers(before, again, inodes) == {}
