"""Start and stop a P/D cluster on Ray: `build_cluster(spec)` is the one entry point.

Actors are named `<spec.name>:<instance>` in the `pdcluster` namespace, so
`pdc status` and `pdc down` find them from another process. `detached=True`
(used by `pdc up`) lets them outlive the launching process; tests use
non-detached actors that die with their driver.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import ray
from pydantic import SecretStr

from pdcluster.cluster.engine_actor import EngineActor
from pdcluster.cluster.placement import NodeView, PlacementError, alive_nodes, check_placement, engine_options
from pdcluster.cluster.placement import router_options as router_placement
from pdcluster.cluster.ray_settings import check_ray_auth
from pdcluster.cluster.sim.cost import CostModel, SimParams
from pdcluster.proto.devices import DEVICES
from pdcluster.proto.messages import InstanceInfo, Role
from pdcluster.proto.names import NAMESPACE, actor_name, is_router, router_name  # noqa: F401  (cli, bench)
from pdcluster.proto.spec import ClusterSpec
from pdcluster.router.pd_dispatch import Instance
from pdcluster.router.prefill_cost import FittedCost, ModelledCost, PrefillCost
from pdcluster.router.run_store import new_run_id
from pdcluster.router.server import RouterActor
from pdcluster.transfer.auth import SECRET_ENV, check_secret, generate_secret
from pdcluster.transfer.network import settle_mode
from pdcluster.transfer.vllm_compat import UnsupportedVllm, check_supported

log = logging.getLogger(__name__)

API_KEYS_ENV = "PDC_API_KEYS"  # comma-separated, for a spec without auth.api_keys


def prefill_cost(spec) -> PrefillCost:
    """P's prefill time as a cluster's router predicts it (a ClusterSpec): the simulated engine's
    own cost model, or one fitted from what P's vLLM engines report. The launcher hands it to the
    router process; the virtual clock's router takes it too."""
    eng = spec.role_engine("prefill")
    if eng.kind == "sim":
        cost = CostModel(SimParams.load(spec.sim.params), eng.block_size, spec.sim.devices_per_instance)
        return ModelledCost(cost, eng.max_num_batched_tokens)
    return FittedCost()


class ClusterStartError(RuntimeError):
    """An instance failed to start; the message names it and carries its error."""


@dataclass
class Cluster:
    spec: ClusterSpec
    prefill: list[Instance]
    decode: list[Instance]
    routers: list[ray.actor.ActorHandle]  # router.processes of them, all serving `url`
    url: str
    infos: list[InstanceInfo]
    run_dir: str | None  # where the routers write this run's timelines (None: recording off)

    @property
    def instances(self) -> list[Instance]:
        return self.prefill + self.decode

    @property
    def router(self) -> ray.actor.ActorHandle:
        """The first router: for what any one answers for all (run_dir, KV-event status)."""
        return self.routers[0]

    def each_router(self, method: str, *args, timeout_s: float = 60.0) -> list:
        """Call a router method on every router and wait: settings (set_policy, ...) and
        barriers (catch_up_kv_events) must reach each, or some requests would miss them."""
        return ray.get([getattr(r, method).remote(*args) for r in self.routers], timeout=timeout_s)


def ensure_model(spec: ClusterSpec) -> None:
    path = Path(spec.model.path)
    if (path / "config.json").exists():
        return
    if spec.model.tiny is None:
        raise ClusterStartError(f"model.path {path} has no config.json (and model.tiny is not set to generate one)")
    from pdcluster.cluster.tiny_model import make_tiny_model

    log.info("generating tiny %s model at %s", spec.model.tiny.arch, path)
    make_tiny_model(path, arch=spec.model.tiny.arch, seed=spec.model.tiny.seed)


def settle_spec(spec: ClusterSpec, nodes: list[NodeView], environ: Mapping[str, str] = os.environ) -> ClusterSpec:
    """The spec every actor gets: its cluster secret (the spec's, else PDC_CLUSTER_SECRET, else
    a new one), its API keys (the spec's, else PDC_API_KEYS), and `network.mode: auto`
    settled from the nodes alive now. Raises PlacementError (naming the field) if the spec
    asks for a node Ray does not have."""
    check_placement(spec, nodes)
    auth = spec.auth
    if auth.secret is None:
        secret = environ.get(SECRET_ENV) or generate_secret()
        auth = auth.model_copy(update={"secret": SecretStr(check_secret(secret, SECRET_ENV))})
    if not auth.api_keys and environ.get(API_KEYS_ENV):
        auth = auth.model_copy(update={"api_keys": [SecretStr(k) for k in environ[API_KEYS_ENV].split(",") if k]})
    net = spec.network
    net = net.model_copy(update={"mode": settle_mode(net.mode, net.interface, net.cidr, len(nodes))})
    return spec.model_copy(update={"auth": auth, "network": net})


def _engine_options(spec: ClusterSpec, role: Role, index: int, detached: bool) -> dict:
    res = getattr(spec, role).resources
    device = DEVICES[spec.device]
    opts: dict = dict(name=actor_name(spec, f"{role}-{index}"), namespace=NAMESPACE, num_cpus=res.cpus,
                      # A dead engine comes back (a new vLLM engine, empty caches); requests
                      # in flight on it fail and the router reports that. Its placement is by
                      # labels, so a host that rejoins gets its instances back.
                      max_restarts=-1, max_concurrency=1000, **engine_options(spec, role, index))
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
    ClusterStartError naming each instance that failed, a line each (or the spec field no
    node satisfies).
    The cluster's spec (`Cluster.spec`) is the settled one (settle_spec).
    """
    try:
        nodes = alive_nodes()
        check_ray_auth(spec.insecure_ray, len({n.ip for n in nodes}), ray.get_runtime_context().gcs_address)
        spec = settle_spec(spec, nodes)
        if spec.role_engine("prefill").kind == "vllm":  # before any engine starts (each engine checks too)
            check_supported()
    except (PlacementError, ValueError, UnsupportedVllm) as err:
        raise ClusterStartError(str(err)) from None
    ensure_model(spec)  # also for engine: sim (the router tokenizes with the model's tokenizer)
    started: list[tuple[str, ray.actor.ActorHandle]] = []
    try:
        for role in ("prefill", "decode"):
            engine_cls = ray.remote(engine_class(spec, role))
            for i in range(getattr(spec, role).instances):
                handle = engine_cls.options(**_engine_options(spec, role, i, detached)).remote(spec, role, i)
                started.append((f"{role}-{i}", handle))
        engines = list(started)
        # The routers load the tokenizer while the engines start (RouterActor.__init__).
        routers = make_routers(spec, detached, started)
        infos, failures = [], []
        deadline = time.monotonic() + start_timeout_s
        for name, handle in engines:  # every instance's fate: a spec's mistakes come out at once
            try:
                infos.append(ray.get(handle.info.remote(), timeout=max(1.0, deadline - time.monotonic())))
            except Exception as err:
                failures.append(f"instance {name} failed to start: {_root_cause(err)}")
        if failures:
            raise ClusterStartError("\n".join(failures))
        prefill = [Instance.of(i, h) for i, (_, h) in zip(infos, engines) if i.role == "prefill"]
        decode = [Instance.of(i, h) for i, (_, h) in zip(infos, engines) if i.role == "decode"]
        url, run_dir = start_routers(spec, routers, prefill, decode, infos)
        return Cluster(spec, prefill, decode, routers, url, infos, run_dir)
    except BaseException:
        for _, handle in started:
            ray.kill(handle, no_restart=True)
        raise


def make_routers(spec: ClusterSpec, detached: bool, started: list[tuple[str, ray.actor.ActorHandle]],
                 body: type = RouterActor) -> list[ray.actor.ActorHandle]:
    """Routers 0..n-1 (router.processes), made now and started by `start_routers`: router 0 on
    the driver's node or one with router.labels, the others on its node (SO_REUSEPORT shares a
    port within one host). Each is added to `started` as it is made. `body`: RouterActor, or a
    subclass (the benchmarks')."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    routers: list[ray.actor.ActorHandle] = []
    node = None
    # Named before any router starts: a router Ray restarts after a crash writes into it again.
    run_dir = str(Path(spec.router.runs_dir) / new_run_id(spec.name)) if spec.router.record_timeline else None
    for k in range(spec.router.processes):
        # A crashed router comes back (Ray restarts it) and serves by itself (RouterActor.resume).
        opts: dict = dict(name=actor_name(spec, router_name(k)), namespace=NAMESPACE, num_cpus=0,
                          max_concurrency=1000, max_restarts=-1)
        if detached:
            opts["lifetime"] = "detached"
        if k == 0:
            opts.update(router_placement(spec, ray.get_runtime_context().get_node_id()))
        else:
            opts["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node, soft=False)
        router = ray.remote(body).options(**opts).remote(spec, k, run_dir, prefill_cost(spec))
        started.append((router_name(k), router))
        routers.append(router)
        if k == 0 and spec.router.processes > 1:
            node = ray.get(router.node_id.remote(), timeout=120)
    return routers


def start_routers(spec: ClusterSpec, routers: list[ray.actor.ActorHandle], prefill: list[Instance],
                  decode: list[Instance], infos: list[InstanceInfo]) -> tuple[str, str | None]:
    """Start each router (make_routers') on these instances, router 0 first: the others write
    into its run directory; then each learns the others (for /metrics). Returns the routers' URL
    and the run directory."""
    url, run_dir = "", None
    for k, router in enumerate(routers):
        try:
            url = ray.get(router.start.remote(prefill, decode, infos, run_dir), timeout=120)
        except Exception as err:
            raise ClusterStartError(f"{router_name(k)} failed to start: {_root_cause(err)}") from None
        if k == 0:
            run_dir = ray.get(router.run_dir.remote())  # as router 0 made it
    if len(routers) > 1:
        ray.get([r.set_peers.remote({router_name(j): p for j, p in enumerate(routers) if p is not r}) for r in routers])
    return url, run_dir


def _root_cause(err: BaseException) -> str:
    # Ray wraps the actor's exception; its last line is the useful one.
    text = str(err).strip().splitlines()
    return text[-1] if text else type(err).__name__


def teardown(cluster: Cluster) -> None:
    stop_routers({router_name(k): r for k, r in enumerate(cluster.routers)})
    for handle in cluster.routers + [i.actor for i in cluster.instances]:
        ray.kill(handle, no_restart=True)


def start_local_ray() -> None:
    """A local Ray on two CPUs in this process, as running_cluster starts one."""
    ray.init(num_cpus=2, include_dashboard=False, namespace=NAMESPACE, log_to_driver=False)


@contextmanager
def running_cluster(spec: ClusterSpec):
    """A Ray and `spec`'s cluster on it, for one driver's use (tests, benches): both gone afterwards,
    even on failure. The Ray is a local one on two CPUs, or the one at the spec's ray_address (a
    lab's: this driver leaves it before the lab goes, as a driver whose GCS vanishes exits its
    process later)."""
    if spec.ray_address:
        ray.init(address=spec.ray_address, namespace=NAMESPACE, log_to_driver=False)
    else:
        start_local_ray()
    try:
        cluster = build_cluster(spec)
        try:
            yield cluster
        finally:
            teardown(cluster)
    finally:
        ray.shutdown()


def stop_routers(routers: dict[str, ray.actor.ActorHandle]) -> None:
    """Stop the routers before their actors are killed: each ends what it still serves,
    records it and fsyncs its run's file (RouterActor.stop). All at once: a stop may take
    uvicorn's graceful second."""
    stops = {name: router.stop.remote() for name, router in routers.items()}
    for name, ref in stops.items():
        try:
            ray.get(ref, timeout=15)
        except Exception as err:  # already dead: nothing to stop
            log.warning("%s stop: %s", name, err)


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
