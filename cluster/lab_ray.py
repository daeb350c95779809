"""The lab's Ray (cluster/lab.py): its token authentication, starting its nodes, and the nodes its
GCS knows, each with the lab host's label."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pdcluster.cluster.lab_tc import LabError

LABEL_KEY = "pdc-host"  # the Ray node label naming a lab host


@dataclass(frozen=True)
class RayNode:
    node_id: str
    address: str
    label: str
    alive: bool


def use_ray_token() -> None:
    """Token auth for the lab's nodes and for this process (cluster/ray_settings.py)."""
    from pdcluster.cluster.ray_settings import use_ray_token as use

    try:
        use()
    except RuntimeError as err:
        raise LabError(str(err)) from None


def ray_nodes(address: str) -> list[RayNode]:
    """Every node the GCS at `address` knows, dead ones included, with its lab label."""
    from ray._raylet import GcsClient
    from ray.core.generated.gcs_pb2 import GcsNodeInfo

    use_ray_token()
    infos = GcsClient(address=address).get_all_node_info(timeout=10).values()
    return [RayNode(node_id=i.node_id.hex(), address=i.node_manager_address, label=i.labels.get(LABEL_KEY, ""),
                    alive=i.state == GcsNodeInfo.GcsNodeState.ALIVE) for i in infos]


def wait_for_nodes(address: str, want: dict[str, str], timeout_s: float, exclude: set[str], logs: str) -> None:
    """Until each label -> address of `want` has a live node (not one of `exclude`)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            have = {(n.label, n.address) for n in ray_nodes(address) if n.alive and n.node_id not in exclude}
        except Exception:  # GCS not answering yet
            have = set()
        if not (missing := set(want.items()) - have):
            return
        if time.monotonic() > deadline:
            raise LabError(f"Ray nodes not up after {timeout_s:.0f} s: {sorted(missing)}; logs in {logs}")
        time.sleep(0.2)


def spawn_ray_starts(nodes: dict[str, tuple[list[str], dict]], log_dir: Path, timeout_s: float,
                     spawned: Callable[[str, int], None]) -> None:
    """Run `ray start`s (what -> (argv, env)) concurrently (each is ~2 s of Python start-up);
    `spawned(what, pid)` as each starts; LabError with the log's tail if one fails. Output goes to
    `log_dir/<what>.log`, never a pipe: Ray's daemons inherit it and keep it open."""
    procs = {}
    for what, (argv, env) in nodes.items():
        log = log_dir / f"{what}.log"
        with open(log, "ab") as out:
            procs[what] = log, subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out,
                                                stderr=subprocess.STDOUT, env=env, start_new_session=True)
        spawned(what, procs[what][1].pid)
    failed = []
    for what, (log, proc) in procs.items():  # every one waited for: none is left a zombie of ours
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = f"timeout, {proc.wait()}"
        if rc != 0:
            failed.append(f"ray start on {what} failed ({rc}); {log}:\n"
                          + "\n".join(log.read_text(errors="replace").splitlines()[-15:]))
    if failed:
        raise LabError("\n".join(failed))
