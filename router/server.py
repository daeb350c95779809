"""The router process: the OpenAI-compatible app served by uvicorn inside a Ray actor.

Living in a (detached) actor lets `pdc up` return while the router keeps
serving, and gives the router the same actor handles to P and D as any
other Ray client.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import socket
import threading
import time
from pathlib import Path

from pdcluster.proto.messages import InstanceInfo
from pdcluster.proto.names import NAMESPACE
from pdcluster.proto.spec import ClusterSpec
from pdcluster.router.backend import ModelCard
from pdcluster.router.generation_defaults import model_sampling_defaults
from pdcluster.router.http_app import BytesResponse, HttpRequest, error_body, json_response
from pdcluster.router.http_protocol import bounded_http, connection_cap
from pdcluster.router.instance_memory import recall_instances, remember_instances
from pdcluster.router.pd_dispatch import Instance, PDDispatcher
from pdcluster.router.pending_blocks import PendingBlocks
from pdcluster.router.prefill_cost import FittedCost, PrefillCost
from pdcluster.router.run_store import FilePolicy, InstanceMeta, RunMeta, RunStore, new_run_id, versions

log = logging.getLogger(__name__)
RESUME_TIMEOUT_S = 120.0  # a restarted router's calls to itself, retried while Ray says it is restarting


def _resume_itself() -> None:
    """A restarted router's own call to its `resume`, from a thread of its own once __init__ has
    returned. Ray may answer a call to an actor still finishing its restart with "the actor is
    restarting" (ActorUnavailableError: once in a clean-clone run, and that router never served
    again): try again until it is taken, for RESUME_TIMEOUT_S."""
    import ray

    me = ray.get_runtime_context().current_actor
    deadline = time.monotonic() + RESUME_TIMEOUT_S
    while True:
        try:
            ray.get(me.resume.remote())
            return
        except ray.exceptions.ActorUnavailableError as err:
            if time.monotonic() > deadline:
                log.error("a restarted router could not resume itself for %.0f s: %s", RESUME_TIMEOUT_S, err)
                return
            time.sleep(0.5)


def model_card(spec: ClusterSpec) -> ModelCard:
    config = json.loads((Path(spec.model.path) / "config.json").read_text())
    max_len = min(spec.role_engine("prefill").max_model_len, spec.role_engine("decode").max_model_len)
    return ModelCard(name=spec.model.served_name, max_model_len=max_len, vocab_size=int(config["vocab_size"]),
                     logits=spec.role_engine("decode").kind != "sim",
                     sampling_defaults=model_sampling_defaults(spec.model.path))


PEER_TIMEOUT_S = 10.0  # another router's /metrics share; a live router answers in milliseconds
STOP_RECORDS_S = 2.0  # at stop, how long cancelled requests get to write their records


def _check_port_free(host: str, port: int) -> None:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as err:
            raise RuntimeError(f"router.port {port} on {host} is not free: {err.strerror}") from None


class RouterActor:
    """Ray actor body (wrapped with ray.remote by the launcher).

    With router.processes > 1, routers 0..n-1 are one actor each on one node, listening on
    one port with SO_REUSEPORT (the kernel hands each new connection to one of them), as
    vLLM's --api-server-count runs several API servers. Each has its own request channels,
    KV-event index and load counts (a load-aware policy sees only its own requests); they
    share one run directory, and each one's /metrics shows the sum of all (`set_peers`).
    """

    def __init__(self, spec: ClusterSpec, index: int = 0, run_dir: str | None = None, cost: PrefillCost | None = None):
        """What needs no instance, most of a router's start (the model's tokenizer, i.e. transformers
        and torch imported): the launcher makes the routers as it makes the engines, so this runs
        while they start, and `start` takes the instances once they are up. `run_dir`: the run's
        directory (the launcher names it before router 0 starts), so that a router Ray restarts
        after a crash writes into the same run; it then starts serving by itself, with the
        instances and peers it had (max_restarts=-1, cluster/launch.py). `cost`: P's prefill time
        as the picker predicts it (cluster/sim/cost.py prefill_cost; None: fitted from what P's
        engines report)."""
        assert cost is not None or spec.role_engine("prefill").kind != "sim", (
            "a simulated cluster's router predicts with the engines' cost model: pass prefill_cost(spec)")
        assert 0 <= index < spec.router.processes, f"router {index} of {spec.router.processes}"
        import ray

        from pdcluster.router.openai_api import load_tokenizer

        self.spec, self.index, self._run_dir, self._cost = spec, index, run_dir, cost
        self.restarted = ray.get_runtime_context().was_current_actor_reconstructed
        self.peers: dict = {}  # the other routers' actor handles by name (router.processes > 1)
        self.tokenizer = load_tokenizer(spec.model.path)
        self.dispatcher: PDDispatcher | None = None  # and the rest below: made by start, from the instances
        self.store: RunStore | None = None
        self._server = None
        self._task: asyncio.Task | None = None
        self._resumed: asyncio.Task | None = None
        if self.restarted:  # nobody else will call start: ask this actor itself, once __init__ returns
            threading.Thread(target=_resume_itself, name="pdc-router-resume", daemon=True).start()

    def _take_instances(self, prefill: list[Instance], decode: list[Instance], infos: list[InstanceInfo]) -> None:
        from pdcluster.proto.kv_event_wire import feed_endpoints
        from pdcluster.proto.router_spec import HttpLimits
        from pdcluster.router.admission import AdmissionLimits
        from pdcluster.router.kv_events import KvEventFeed
        from pdcluster.router.metrics import RouterMetrics
        from pdcluster.router.openai_api import build_app
        from pdcluster.transfer.auth import curve_keys

        spec = self.spec
        block_size = spec.role_engine("prefill").block_size
        self.infos = infos
        # Every instance's KV cache events, whatever the policy: the predicted hits are
        # recorded for every request (and prefix_aware routes by them). At the addresses the
        # instances advertise, with the cluster's keys (the engines publish to nobody else).
        self.kv_events = KvEventFeed(feed_endpoints(infos), block_size, curve=curve_keys(spec.secret()),
                                     groups={i.name: i.kv_groups for i in infos}).start()
        self.dispatcher = PDDispatcher(prefill, decode, model_card(spec), spec.router.request_timeout_s,
                                       transfer_mode=spec.transfer.mode, transport=spec.transfer.backend,
                                       policy=spec.router.policy, block_size=block_size, lookup=self.kv_events,
                                       pending=PendingBlocks() if spec.router.track_pending else None,
                                       cost=self._cost if self._cost is not None else FittedCost(),
                                       local=spec.router.local_prefill, p_pool=spec.router.p_pool,
                                       admission=AdmissionLimits.settle(
                                           spec.router.admission,
                                           decode_slots=len(decode) * spec.role_engine("decode").max_num_seqs,
                                           request_timeout_s=spec.router.request_timeout_s),
                                       migration_limit=spec.router.migration_limit)
        self.dispatcher.core.fault_prefix = spec.transfer.break_transfers_with_prefix
        # An instance restarted on another node publishes its KV events there.
        self.dispatcher.instance_listeners.append(
            lambda info: self.kv_events.redial(info.name, info.planes.kv_events, info.planes.kv_events_replay))
        def pending_blocks(name: str) -> int:  # whatever index the picker has now (set_track_pending)
            pending = self.dispatcher.picker.pending
            return 0 if pending is None else pending.counts(name).blocks

        self.metrics = RouterMetrics(lambda: self.dispatcher.in_flight,
                                     pending_blocks if spec.router.track_pending else None,
                                     lambda: self.app.refused, self.kv_events.tier_blocks)
        self.dispatcher.sinks.append(self.metrics.observe)
        self.spans = None  # each request's phases as OpenTelemetry spans (spec observability.otlp_endpoint)
        if spec.observability.otlp_endpoint:
            from pdcluster.router.otlp import OtlpSpans

            self.spans = OtlpSpans(spec.observability.otlp_endpoint, spec.model.served_name,
                                   spec.observability.service_name)
            self.dispatcher.sinks.append(self.spans.observe)
        self.dispatcher.rejection_listeners.append(self.metrics.reject)
        self.dispatcher.sink_failure_listeners.append(self.metrics.record_failed)
        model = spec.model
        parsers = None
        if model.tool_call_parser or model.reasoning_parser:  # vLLM's parsers: imported only for them
            from pdcluster.router.chat_parsers import ChatParsers

            parsers = ChatParsers(model.path, model.tool_call_parser, model.reasoning_parser,
                                  model.enable_auto_tool_choice)
        self.app = build_app(self.dispatcher, self.tokenizer, HttpLimits(
            spec.router.max_body_bytes, spec.router.body_timeout_s, spec.router.client_stall_s), parsers)
        if spec.auth.api_keys:
            self.app.require_api_keys([k.get_secret_value() for k in spec.auth.api_keys],
                                      ("/health", "/metrics") if spec.auth.open_metrics else ("/health",))
        self.app.add("GET", "/metrics", self._metrics_page)
        self.app.add("GET", "/pdc/run", self._run_page)

    async def _metrics_page(self, request: HttpRequest) -> BytesResponse:
        page = self.metrics.render()
        from pdcluster.router.metrics import merge_expositions, refusals_page, tier_counts_page

        if self.peers:
            # A peer that is gone fails the page, naming it: a sum without its counts would be wrong.
            pages = await asyncio.gather(*(asyncio.wait_for(p.own_metrics.remote(), PEER_TIMEOUT_S)
                                           for p in self.peers.values()), return_exceptions=True)
            failed = {name: err for name, err in zip(self.peers, pages) if isinstance(err, BaseException)}
            if failed:
                said = "; ".join(f"{name}: {type(err).__name__}" for name, err in failed.items())
                return json_response(error_body(f"metrics of the other router processes did not come ({said})",
                                                "service_unavailable"), 503)
            page = merge_expositions([page, *pages])
        # The instances' refusals and tiers, asked by whichever router serves the page (not summed over routers).
        refusals, tiers = await asyncio.gather(self.dispatcher.refusals(), self.dispatcher.tier_counts())
        page = merge_expositions([page, refusals_page(refusals), tier_counts_page(tiers)])
        return BytesResponse(page, media_type=self.metrics.content_type)

    def own_metrics(self) -> bytes:
        """This router's /metrics page alone (a peer merges it into its own)."""
        return self.metrics.render()

    def set_peers(self, peers: dict) -> None:
        """The other routers of this cluster: actor name -> handle."""
        self.peers = peers

    async def resume(self) -> str:
        """After Ray restarted this router (its process crashed): serve again, as before, with the
        other routers of the cluster as its peers. Called by the router itself (the launcher is long
        gone), maybe more than once (_resume_itself retries): the first call's start serves them all."""
        if self._resumed is None:
            self._resumed = asyncio.ensure_future(self._resume())
        return await asyncio.shield(self._resumed)

    async def _resume(self) -> str:
        import ray

        from pdcluster.proto.names import actor_name, router_name

        infos = recall_instances(self.spec)
        handles = {i.name: ray.get_actor(actor_name(self.spec, i.name), namespace=NAMESPACE) for i in infos}
        url = await self.start([Instance.of(i, handles[i.name]) for i in infos if i.role == "prefill"],
                               [Instance.of(i, handles[i.name]) for i in infos if i.role == "decode"], infos)
        self.peers = {router_name(j): ray.get_actor(actor_name(self.spec, router_name(j)), namespace=NAMESPACE)
                      for j in range(self.spec.router.processes) if j != self.index}
        log.warning("router %d restarted after a crash; serving again at %s", self.index, url)
        return url

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    async def _run_page(self, request: HttpRequest) -> BytesResponse:
        """Where this router writes timelines, so a load generator can join them to its requests."""
        return json_response({"run_dir": self.run_dir(), "cluster": self.spec.name})

    async def _open_run(self, infos: list[InstanceInfo], run_dir: str | None) -> RunStore:
        """Measure each instance's clock, then start this run's directory (router 0), or
        join the one router 0 started (run_dir); a restarted router joins as a new writer."""
        import ray

        here = ray.util.get_node_ip_address()
        clocks = await self.dispatcher.measure_clocks({i.name for i in infos if i.node_ip == here})
        r = self.spec.router
        policy = FilePolicy(r.record_file_mb << 20, r.record_files_kept, r.record_fsync_s)
        if self.restarted:
            assert run_dir is not None, "a restarted router writes into its run: the launcher names it"
            return RunStore(run_dir, None, RunStore.new_writer(Path(run_dir), self.spec.router.processes), policy)
        if self.index > 0:
            assert run_dir is not None, f"router {self.index} writes into router 0's run directory: none given"
            return RunStore(run_dir, None, self.index, policy)
        started_mono, started_wall = time.monotonic_ns(), time.time_ns()
        path = Path(run_dir) if run_dir else Path(self.spec.router.runs_dir) / new_run_id(self.spec.name)
        meta = RunMeta(run_id=path.name, started_wall_ns=started_wall, started_mono_ns=started_mono,
                       spec=self.spec.model_dump(mode="json"), versions=versions(),
                       instances=[InstanceMeta(i.name, i.role, i.node_ip, i.pid, clocks[i.name]) for i in infos])
        return RunStore(path, meta, 0, policy)

    async def start(self, prefill: list[Instance], decode: list[Instance], infos: list[InstanceInfo],
                    run_dir: str | None = None) -> str:
        """Route to these instances and serve on router.host:port; return the base URL once it
        accepts connections. run_dir: the run's directory (default: the one the launcher named)."""
        import uvicorn

        self._take_instances(prefill, decode, infos)
        if not self.restarted:
            remember_instances(self.spec, infos)
        run_dir = run_dir or self._run_dir
        if self.spec.router.record_timeline:
            self.store = await self._open_run(self.infos, run_dir)
            self.dispatcher.sinks.append(self.store.append)
            self.dispatcher.begin_sinks.append(self.store.begin)
        r = self.spec.router
        host = self._host()
        if self.index == 0 and not self.restarted:  # (restarted: its peers may hold the port, rightly)
            # uvicorn would sys.exit() inside this actor instead. Checked without SO_REUSEPORT
            # even for several routers: a stale cluster's routers would share the port otherwise.
            _check_port_free(host, r.port)
        listening = self._listening_socket()
        await self.dispatcher.connect_channels(self.spec.secret())
        # What is alive now (Ray, the tokenizer, transformers) lives as long as the router: out of
        # the collector's full passes, each of which held the event loop ~200 ms over such a heap.
        gc.freeze()
        # No access log or X-Forwarded-For rewriting: per-request work the router has no use for.
        http = bounded_http(r.header_timeout_s, connection_cap(r.max_connections), self.app.refused_one)
        self._server = uvicorn.Server(uvicorn.Config(self.app, host=host, port=r.port, log_level="warning",
                                                     access_log=False, proxy_headers=False, http=http,
                                                     timeout_graceful_shutdown=1))
        self._task = asyncio.create_task(self._server.serve(sockets=None if listening is None else [listening]))
        while not self._server.started:
            if self._task.done():  # e.g. the port is taken
                exc = self._task.exception()
                raise RuntimeError(f"router could not serve on {host}:{r.port}: {exc or 'server exited'}")
            await asyncio.sleep(0.05)
        return f"http://{host}:{r.port}"

    def _host(self) -> str:
        """router.host, or (unset) loopback, or this router's node address when router.labels
        placed it on another host."""
        r = self.spec.router
        if r.host is not None or not r.labels:
            return r.bind_host("")  # the node's address is not needed
        import ray

        return r.bind_host(ray.util.get_node_ip_address())

    def _listening_socket(self) -> socket.socket | None:
        """None: uvicorn binds router.host:port itself. Several routers: each binds it with
        SO_REUSEPORT (router 0 first checked that nothing else holds it)."""
        r = self.spec.router
        if r.processes == 1:
            return None
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        host = self._host()
        try:
            sock.bind((host, r.port))
        except OSError as err:
            sock.close()
            raise RuntimeError(f"router.port {r.port} on {host} is not free: {err.strerror}") from None
        return sock

    def set_recording(self, on: bool) -> None:
        """Turn the record sinks (run directory, metrics) on or off: for measuring their cost."""
        self.dispatcher.sinks = ([self.metrics.observe] + ([self.store.append] if self.store else [])
                                 + ([self.spans.observe] if self.spans else [])) if on else []
        self.dispatcher.begin_sinks = [self.store.begin] if on and self.store else []

    def set_transfer_mode(self, mode: str, transport: str | None = None) -> None:
        """push or pull, over grpc or torch_dist, from the next request on (the pdc connector
        serves all four): to compare them on one cluster."""
        assert mode in ("push", "pull"), f"unknown transfer mode {mode!r}"
        assert transport in (None, "grpc", "torch_dist"), f"unknown transport {transport!r}"
        assert (mode == "pull" and transport in (None, "grpc")) or self.spec.transfer.connector == "pdc", (
            "only the pdc connector pushes or uses torch_dist")
        self.dispatcher.transfer_mode = mode
        if transport is not None:
            self.dispatcher.transport = transport

    def set_policy(self, policy: str) -> None:
        """Route by another policy from the next request on: to compare them on one cluster."""
        from pdcluster.proto.router_spec import POLICIES

        assert policy in POLICIES, f"unknown routing policy {policy!r}; one of {', '.join(POLICIES)}"
        self.dispatcher.picker.policy = policy

    def set_track_pending(self, on: bool) -> None:
        """router.track_pending from the next request on (a fresh, empty pending index when on)."""
        self.dispatcher.picker.pending = PendingBlocks() if on else None

    def set_local_prefill(self, fields: dict) -> None:
        """router.local_prefill as given (a LocalPrefillSpec's fields), from the next request on:
        to compare D prefilling short remainders with every prefill on P, on one cluster."""
        from pdcluster.proto.router_spec import LocalPrefillSpec

        spec = LocalPrefillSpec.model_validate(fields)
        self.dispatcher.picker.local = spec if spec.policy != "never" else None

    def catch_up_kv_events(self, timeout_s: float = 10.0) -> None:
        """Return once every KV event each instance had published is in the router's index
        (a barrier for tests and tools; routing never waits for it)."""
        self.kv_events.catch_up(timeout_s)

    def kv_event_status(self) -> dict:
        """Each instance's KV-event feed as the router sees it (router/kv_events.py FeedStatus)."""
        return {name: self.kv_events.status(name) for name in self.kv_events.instances}

    def run_dir(self) -> str | None:
        return str(self.store.path) if self.store else None

    async def stop(self) -> None:
        """Stop serving: requests still running after uvicorn's graceful second are ended (and
        recorded as ended by the stop); then the run's file is flushed and fsynced."""
        if self.dispatcher is None:  # never started: nothing to end
            return
        self.dispatcher.stopping = True
        try:
            if self._server is not None:
                self._server.should_exit = True
                await asyncio.wait_for(self._task, timeout=10)
            # uvicorn cancelled what still ran: let each one's record be written.
            deadline = time.monotonic() + STOP_RECORDS_S
            while self.dispatcher.accepted_in_flight and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
        finally:
            self.kv_events.stop()
            self.dispatcher.close_channels()
            if self.store is not None:
                self.store.close()
                self.store = None
            if self.spans is not None:
                self.spans.close()  # the batch still queued goes out first
                self.spans = None
