"""The multi-host lab (cluster/lab.py, lab_tc.py), its pure parts, without root: address plans,
interface names, overlaps, tc commands, the state file, the CLI. The end-to-end part, on one
real lab, is tests/test_lab_e2e.py.
"""


from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from e2e import wait_until

from pdcluster.cluster import lab_procs, lab_tc
from pdcluster.cluster.lab import (
    IFNAMSIZ,
    LABEL_KEY,
    Lab,
    LabError,
    find_overlaps,
)
from pdcluster.cluster.lab_cli import add_lab_commands
from pdcluster.cluster.lab_tc import Egress, LinkEnd, egress_commands, rate_bits, tbf_args

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
    for bad in (0, 17):  # each host a Ray node on this one machine: 16 at most
        with pytest.raises(LabError, match=rf"hosts: {bad} \(1 to 16"):
            Lab.plan(hosts=bad, subnet="10.213.0.0/24")


def test_interface_names_fit_the_kernel(lab_dir):
    lab = Lab.plan(hosts=16, name="abcdefghi")  # the longest name that fits 16 hosts
    names = [lab.bridge] + [n for h in lab.hosts for n in (h.veth, h.peer)]
    assert max(map(len, names)) == IFNAMSIZ == 15 and len(set(names)) == len(names)
    with pytest.raises(LabError, match=r"'abcdefghij-h10ns' is 16 characters \(max 15\).*at most 9 characters"):
        Lab.plan(hosts=16, name="abcdefghij")
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


def test_egress_tree_commands_touch_only_what_changes():
    end, dev = LinkEnd(None, "v"), ["dev", "v"]
    tree = [["tc", "qdisc", "replace", *dev, "root", "handle", "1:", "htb", "default", "10"],
            ["tc", "class", "replace", *dev, "parent", "1:", "classid", "1:10", *lab_tc._PASS_ALL],
            ["tc", "class", "replace", *dev, "parent", "1:", "classid", "1:20", *lab_tc._PASS_ALL],
            ["tc", "qdisc", "replace", *dev, "parent", "1:20", "handle", "20:", "pfifo", "limit", "0"]]
    filters = ["tc", "filter", "replace", *dev, "parent", "1:", "protocol", "ip", "prio", "1", "handle"]
    cut2 = filters + ["800::2", "u32", "match", "ip", "src", "10.0.0.3/32", "flowid", "1:20"]
    tbf = ["tc", "qdisc", "replace", *dev, "parent", "1:10", "handle", "10:"]
    shaped, cut = Egress("50mbit", "50ms"), Egress("50mbit", "50ms", {2: "10.0.0.3"})
    assert egress_commands(end, Egress(), Egress()) == []  # an untouched link has no qdisc at all
    assert egress_commands(end, Egress(), shaped) == tree + [tbf + tbf_args("50mbit", "50ms")]
    assert egress_commands(end, Egress(), Egress(drop_from={2: "10.0.0.3"})) == tree + [cut2]
    assert egress_commands(end, shaped, cut) == [cut2]  # partition while shaped: the tbf stays
    assert egress_commands(end, cut, replace(cut, rate="20mbit")) == [tbf + tbf_args("20mbit", "50ms")]  # no gap
    assert egress_commands(end, cut, replace(cut, rate=None, latency=None)) == [
        ["tc", "qdisc", "del", *dev, "parent", "1:10", "handle", "10:"]]
    two = replace(cut, drop_from={2: "10.0.0.3", 12: "10.0.0.13"})
    assert egress_commands(end, cut, two) == [filters + ["800::c", "u32", "match", "ip", "src", "10.0.0.13/32",
                                                         "flowid", "1:20"]]  # u32 handles are hex
    assert egress_commands(end, two, cut) == [["tc", "filter", "del", *dev, "parent", "1:", "protocol", "ip",
                                               "prio", "1", "handle", "800::c", "u32"]]
    assert egress_commands(end, cut, Egress()) == [["tc", "qdisc", "del", *dev, "root"]]
    assert LinkEnd("ns", "p").tc("qdisc", "show") == ["tc", "-n", "ns", "qdisc", "show"]
    with pytest.raises(LabError, match="host index 4096"):
        egress_commands(end, Egress(), Egress(drop_from={4096: "10.0.16.1"}))


def test_partition_cuts_both_ways_on_the_bridge_and_is_recorded(lab_dir, monkeypatch):
    ran = []
    monkeypatch.setattr(lab_tc, "run", lambda argv, check=True: ran.append(argv))
    lab = Lab.plan(hosts=3, name="pt")
    Path(lab.state_dir).mkdir()
    lab._save()
    lab.partition("host1", 2)
    drops = [(a[a.index("dev") + 1], a[a.index("src") + 1]) for a in ran if a[1] == "filter"]
    assert drops == [("pt-h1", "10.213.0.3/32"), ("pt-h2", "10.213.0.2/32")]  # each end drops the other's
    assert not [a for a in ran if "-n" in a]  # on the bridge ends only: no host's stack sees a drop
    assert lab.partitions == Lab.attach("pt").partitions == [("host1", "host2")]
    ran.clear()
    lab.partition(lab.host(2), "1")  # idempotent, either order
    Lab.attach("pt").shape("host1", "100mbit")  # another Lab object: `lab` reads the change before its next
    assert not [a for a in ran if a[1] == "filter"]
    ran.clear()
    lab.heal("host2", "host1")
    assert ran == [["tc", "qdisc", "del", "dev", "pt-h2", "root"],  # host2 has nothing left
                   ["tc", "filter", "del", "dev", "pt-h1", "parent", "1:", "protocol", "ip", "prio", "1",
                    "handle", "800::2", "u32"]]  # host1 stays shaped
    assert Lab.attach("pt").partitions == [] and Lab.attach("pt").host(1).rate == "100mbit"
    with pytest.raises(LabError, match="two hosts"):
        lab.partition(1, "host1")
    with pytest.raises(LabError, match="no host 9"):
        lab.heal(1, 9)


def test_state_file_round_trip_and_down_without_one(lab_dir):
    lab = Lab.plan(hosts=2, name="rt")
    lab.ray_port, lab.head_sid, lab.hosts[1].rate = 6380, 1234, "100mbit"
    lab.hosts[0].partitioned_from, lab.hosts[1].partitioned_from = ["host2"], ["host1"]
    Path(lab.state_dir).mkdir()
    lab._save()
    assert Lab.attach("rt") == lab
    assert Lab.down_by_name("nolab") is False
    with pytest.raises(LabError, match="no lab 'nolab'"):
        Lab.attach("nolab")


# ---- what the lab trusts (issue 26 item 8) ----


def _saved(name: str = "own") -> Lab:
    lab = Lab.plan(hosts=2, name=name)
    os.mkdir(lab.state_dir, 0o700)
    lab._save()
    return lab


def test_a_planted_state_file_is_refused_and_nothing_it_names_is_touched(lab_dir, tmp_path_factory):
    """A state.json naming another directory made `pdc lab down` delete it (and would delete
    links and kill processes it named)."""
    victim = tmp_path_factory.mktemp("victim")
    (victim / "keep").write_text("x")
    lab = _saved()
    state = Path(lab.state_dir) / "state.json"
    saved = json.loads(state.read_text())
    for field, value in (("state_dir", str(victim)), ("bridge", "eth0"), ("head_address", "10.0.0.9")):
        state.write_text(json.dumps(saved | {field: value}))
        with pytest.raises(LabError, match=f"names what this lab would not have made \\({field}\\)"):
            Lab.down_by_name("own")
    saved["hosts"][1]["netns"] = "somebody-elses"
    state.write_text(json.dumps(saved))
    with pytest.raises(LabError, match=r"hosts\[1\]\.netns"):
        Lab.attach("own")
    assert (victim / "keep").exists() and state.exists()


@pytest.mark.parametrize("problem", ["other owner", "others write", "group writes", "a link"])
def test_a_root_someone_else_could_write_is_refused(tmp_path, monkeypatch, problem):
    root = tmp_path / "root"
    root.mkdir(mode=0o700)
    if problem == "other owner":
        os.chown(root, 65534, 65534)
    elif problem == "others write":
        root.chmod(0o1777)  # as /tmp itself
    elif problem == "group writes":
        root.chmod(0o770)
    else:
        real, root = root, tmp_path / "link"
        root.symlink_to(real)
    monkeypatch.setenv("PDC_LAB_DIR", str(root))
    want = {"other owner": "belongs to uid 65534", "others write": "can be written by others",
            "group writes": "can be written by others", "a link": "is not a directory"}[problem]
    with pytest.raises(LabError, match=want):
        Lab.attach("x")
    with pytest.raises(LabError, match=want):
        Lab.up(hosts=1, name="x")  # before anything is made (needs root: the suite runs as root)
    assert not (root / "x").exists()


def test_the_root_and_a_lab_s_directory_are_made_private(tmp_path, monkeypatch):
    monkeypatch.setenv("PDC_LAB_DIR", str(tmp_path / "fresh"))
    from pdcluster.cluster.lab_state import lab_root, private_dir

    assert private_dir(lab_root()).stat().st_mode & 0o777 == 0o700
    lab = _saved()
    assert os.stat(lab.state_dir).st_mode & 0o777 == 0o700
    assert Lab.attach("own") == lab


def test_cli(lab_dir, capsys):
    ap = argparse.ArgumentParser(prog="pdc")
    add_lab_commands(ap.add_subparsers(dest="cmd", required=True))
    a = ap.parse_args(["lab", "up", "--hosts", "4", "--rate", "200mbit", "--name", "x"])
    assert (a.hosts, a.rate, a.latency, a.name, a.subnet) == (4, "200mbit", None, "x", "10.213.0.0/24")
    assert ap.parse_args(["lab", "exec", "host1", "--", "ls", "-l"]).cmd == ["ls", "-l"]
    assert ap.parse_args(["lab", "link", "host2", "down"]).state == "down"
    a = ap.parse_args(["lab", "partition", "host1", "2"])
    assert (a.lab_cmd, a.a, a.b) == ("partition", "host1", "2") and ap.parse_args(["lab", "heal", "1", "2"]).b == "2"
    from pdcluster.cluster.cli import main  # the hook in `pdc`

    with pytest.raises(SystemExit) as err:
        main(["lab", "status", "--name", "nolab"])
    assert err.value.code == 2 and "no lab 'nolab'" in capsys.readouterr().err
    main(["lab", "down", "--name", "nolab"])  # idempotent: nothing to do is fine
    assert "nothing to do" in capsys.readouterr().out


# ---- kills ----


def _spawn_sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def test_a_killed_process_cannot_act_before_it_is_reaped():
    """A SIGKILLed child stays a zombie until its parent waits: it exists, yet can never act
    again. Exiting and SIGKILL-pending processes are the same case the lab met under load."""
    proc = _spawn_sleeper()
    try:
        assert lab_procs._can_act(proc.pid)
        os.kill(proc.pid, signal.SIGKILL)
        wait_until(lambda: not lab_procs._can_act(proc.pid), 10, interval=0.01, what="the killed child unable to act")
        assert Path(f"/proc/{proc.pid}").exists(), "not yet reaped: the case kill_host must not wait on"
    finally:
        proc.kill()
        proc.wait()
    assert not lab_procs._can_act(proc.pid)  # gone


def test_kill_all_returns_once_nothing_listed_can_act():
    procs = [_spawn_sleeper() for _ in range(3)]
    try:
        pids = [p.pid for p in procs]
        # `find` keeps listing them (as `ip netns pids` lists a process until it has left): killed
        # and not yet reaped is enough, with no error.
        lab_procs._kill_all(lambda: pids, reap=False, timeout_s=5.0)
        assert not any(lab_procs._can_act(pid) for pid in pids)
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_kill_all_names_what_it_could_not_kill(monkeypatch):
    monkeypatch.setattr(lab_procs.os, "kill", lambda pid, sig: None)  # SIGKILL that never lands
    proc = _spawn_sleeper()
    try:
        with pytest.raises(LabError, match=f"still running after SIGKILL: \\[{proc.pid}\\]"):
            lab_procs._kill_all(lambda: [proc.pid], reap=False, timeout_s=0.2)
    finally:
        monkeypatch.undo()  # os.kill is everyone's
        proc.kill()
        proc.wait()
