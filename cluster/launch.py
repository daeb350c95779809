"""Start and stop a P/D cluster on Ray: `build_cluster(spec)` is the one entry point.

Actors are named `<spec.name>:<instance>` in the `pdcluster` namespace, so
`pdc status` and `pdc down` find them from another process. `detached=True`
(used by `pdc up`) lets them outlive the launching process; tests use
non-detached actors that die with their driver.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import ray

from pdcluster.cluster.devices import DEVICES
from pdcluster.cluster.engine_actor import EngineActor
from pdcluster.cluster.messages import InstanceInfo, Role
from pdcluster.cluster.spec import ClusterSpec
from pdcluster.router.pd_dispatch import Instance
from pdcluster.router.server import RouterActor

log = logging.getLogger(__name__)

NAMESPACE = "pdcluster"
ROUTER = "router"


class ClusterStartError(RuntimeError):
    """An instance failed to start; the message names it and carries its error."""


@dataclass
class Cluster:
    spec: ClusterSpec
    prefill: list[Instance]
    decode: list[Instance]
    router: ray.actor.ActorHandle
    url: str
    infos: list[InstanceInfo]
    run_dir: str | None  # where the router writes this run's timelines (None: recording off)

    @property
    def instances(self) -> list[Instance]:
        return self.prefill + self.decode


def actor_name(spec: ClusterSpec, instance: str) -> str:
    return f"{spec.name}:{instance}"


def ensure_model(spec: ClusterSpec) -> None:
    path = Path(spec.model.path)
    if (path / "config.json").exists():
        return
    if spec.model.tiny is None:
        raise ClusterStartError(f"model.path {path} has no config.json (and model.tiny is not set to generate one)")
    from pdcluster.cluster.tiny_model import make_tiny_model

    log.info("generating tiny %s model at %s", spec.model.tiny.arch, path)
    make_tiny_model(path, arch=spec.model.tiny.arch, seed=spec.model.tiny.seed)


def _engine_options(spec: ClusterSpec, role: Role, index: int, detached: bool) -> dict:
    res = getattr(spec, role).resources
    device = DEVICES[spec.device]
    opts: dict = dict(name=actor_name(spec, f"{role}-{index}"), namespace=NAMESPACE, num_cpus=res.cpus,
                      # A dead engine comes back (a new vLLM engine, empty caches); requests
                      # in flight on it fail and the router reports that.
                      max_restarts=-1, max_concurrency=1000)
    if device.ray_resource == "GPU":
        opts["num_gpus"] = res.gpus
    elif device.ray_resource is not None:
        opts["resources"] = {device.ray_resource: res.npus}
    if detached:
        opts["lifetime"] = "detached"
    return opts


def engine_class(spec: ClusterSpec, role: Role) -> type:
    """The actor body of one role's instances: a vLLM engine, or the simulated one (cluster/sim)."""
    if spec.role_engine(role).kind == "sim":
        from pdcluster.cluster.sim.engine import SimEngineActor

        return SimEngineActor
    return EngineActor


def build_cluster(spec: ClusterSpec, detached: bool = False, start_timeout_s: float = 600.0) -> Cluster:
    """Start every P and D engine and the router; return once all are healthy.

    Needs ray.init() done. On any failure, kills what it started and raises
    ClusterStartError naming the instance.
    """
    ensure_model(spec)  # also for engine: sim (the router tokenizes with the model's tokenizer)
    started: list[tuple[str, ray.actor.ActorHandle]] = []
    try:
        for role in ("prefill", "decode"):
            engine_cls = ray.remote(engine_class(spec, role))
            for i in range(getattr(spec, role).instances):
                handle = engine_cls.options(**_engine_options(spec, role, i, detached)).remote(spec, role, i)
                started.append((f"{role}-{i}", handle))
        infos = []
        deadline = time.monotonic() + start_timeout_s
        for name, handle in started:
            try:
                infos.append(ray.get(handle.info.remote(), timeout=max(1.0, deadline - time.monotonic())))
            except Exception as err:
                raise ClusterStartError(f"instance {name} failed to start: {_root_cause(err)}") from None
        by_name = {i.name: i for i in infos}
        prefill = [Instance(n, h, by_name[n].engine_id, by_name[n].kv_address) for n, h in started
                   if n.startswith("prefill")]
        decode = [Instance(n, h, by_name[n].engine_id, by_name[n].kv_address) for n, h in started
                  if n.startswith("decode")]
        router_opts = dict(name=actor_name(spec, ROUTER), namespace=NAMESPACE, num_cpus=0, max_concurrency=1000)
        if detached:
            router_opts["lifetime"] = "detached"
        router = ray.remote(RouterActor).options(**router_opts).remote(spec, prefill, decode)
        started.append((ROUTER, router))
        try:
            url = ray.get(router.start.remote(infos), timeout=120)
        except Exception as err:
            raise ClusterStartError(f"router failed to start: {_root_cause(err)}") from None
        return Cluster(spec, prefill, decode, router, url, infos, ray.get(router.run_dir.remote()))
    except BaseException:
        for _, handle in started:
            ray.kill(handle, no_restart=True)
        raise


def _root_cause(err: BaseException) -> str:
    # Ray wraps the actor's exception; its last line is the useful one.
    text = str(err).strip().splitlines()
    return text[-1] if text else type(err).__name__


def teardown(cluster: Cluster) -> None:
    try:
        ray.get(cluster.router.stop.remote(), timeout=15)
    except Exception as err:  # already dead: nothing to stop
        log.warning("router stop: %s", err)
    for handle in [cluster.router] + [i.actor for i in cluster.instances]:
        ray.kill(handle, no_restart=True)


def find_actors(cluster_name: str | None = None) -> dict[str, ray.actor.ActorHandle]:
    """Named pdcluster actors in the connected Ray cluster: 'name:instance' -> handle."""
    out = {}
    for entry in ray.util.list_named_actors(all_namespaces=True):
        if entry["namespace"] != NAMESPACE:
            continue
        name = entry["name"]
        if cluster_name is None or name.startswith(f"{cluster_name}:"):
            out[name] = ray.get_actor(name, namespace=NAMESPACE)
    return out
