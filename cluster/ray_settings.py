"""The Ray settings the cluster's safety rests on: token authentication, and how soon Ray
declares an unreachable host dead. `pdc up` (when it starts Ray) and the lab start Ray with both.

Node-failure detection: Ray's GCS checks each node every `period_ms`; `failure_threshold`
failed checks in a row declare it dead. Its actors are then lost for good on that node (Ray
restarts them elsewhere, or on the host once it rejoins as a new node), and its raylet exits
once it hears. A check of a host whose link is cut fails after `timeout_ms` (no answer), one
of a raylet that died fails at once (refused); the next is sent `period_ms` after. So a host
is declared dead no sooner than `tolerance_s` = threshold x period after it vanished, and no
later than `bound_s` = threshold x (period + timeout). The spec's `partition_tolerance_s`
(default 30 s: a switch reboot or a flapping link is shorter) sets the threshold; with
Ray's defaults (3 s, 10 s, 5) it is 15-65 s, and the lab used to take 4.5 s (an 8 s cut lost a
host until revived by hand). A raylet that cannot reach the GCS exits after
`gcs_rpc_server_reconnect_timeout_s` (Ray: 60 s): kept above `bound_s`.

The settings go in the head's `--system-config` (non-head nodes take it from the GCS), so
`pdc up` can read them back from a Ray cluster it joins (`FailureDetection.of_cluster`).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

PERIOD_MS, TIMEOUT_MS = 1000, 500
RAY_DEFAULT = {"health_check_period_ms": 3000, "health_check_timeout_ms": 10000, "health_check_failure_threshold": 5}
RAY_RECONNECT_S = 60  # Ray's gcs_rpc_server_reconnect_timeout_s


@dataclass(frozen=True)
class FailureDetection:
    period_ms: int
    timeout_ms: int
    failure_threshold: int

    @classmethod
    def tolerating(cls, tolerance_s: float) -> FailureDetection:
        """Detection that declares no host dead that was gone for less than `tolerance_s`."""
        return cls(PERIOD_MS, TIMEOUT_MS, max(1, math.ceil(tolerance_s * 1000 / PERIOD_MS)))

    @classmethod
    def of_cluster(cls, system_config: dict) -> FailureDetection:
        """What a running Ray cluster's system config (ray._private.state) sets, Ray's defaults elsewhere."""
        get = lambda key: int(system_config.get(key, RAY_DEFAULT[key]))  # noqa: E731
        return cls(get("health_check_period_ms"), get("health_check_timeout_ms"), get("health_check_failure_threshold"))

    @property
    def tolerance_s(self) -> float:
        return self.failure_threshold * self.period_ms / 1000

    @property
    def bound_s(self) -> float:
        return self.failure_threshold * (self.period_ms + self.timeout_ms) / 1000

    def system_config(self) -> dict[str, int]:
        return {"health_check_period_ms": self.period_ms, "health_check_timeout_ms": self.timeout_ms,
                "health_check_failure_threshold": self.failure_threshold,
                "gcs_rpc_server_reconnect_timeout_s": max(RAY_RECONNECT_S, math.ceil(2 * self.bound_s))}

    def ray_start_arg(self) -> str:
        return f"--system-config={json.dumps(self.system_config(), separators=(',', ':'))}"

    def describe(self) -> str:
        return f"a host is declared dead {self.tolerance_s:g}-{self.bound_s:g} s after it became unreachable"


def use_ray_token() -> None:
    """Ray token auth for the Ray this process starts or joins, with the machine's own Ray token
    (~/.ray/auth_token, made if missing), as one real cluster shares one token. Why not disabled:
    a process that ever ran a local ray.init() is in token mode for good (Ray's default since 2.52),
    and its driver then refuses every call from nodes without the token."""
    from ray._private.authentication import authentication_token_setup as ray_auth
    from ray._raylet import AuthenticationTokenLoader

    if os.environ.get(ray_auth.AUTH_MODE_ENV_VAR, "token").lower() != "token":
        raise RuntimeError(f"{ray_auth.AUTH_MODE_ENV_VAR}={os.environ[ray_auth.AUTH_MODE_ENV_VAR]} in this process, "
                           "but pdcluster starts Ray with token authentication: unset it")
    loader = AuthenticationTokenLoader.instance()
    if not loader.has_token(ignore_auth_mode=True):
        ray_auth.generate_and_save_token()
        loader.reset_cache()
    if ray_auth.AUTH_MODE_ENV_VAR not in os.environ:
        ray_auth._enable_token_auth()  # this process's own calls (and its children's) carry the token


def ray_requires_token(gcs_address: str, timeout_s: float = 5.0) -> bool:
    """Whether the Ray cluster at `gcs_address` refuses a call without Ray's token: one
    GetAllNodeInfo sent bare (with token auth its GCS answers UNAUTHENTICATED; without, the
    nodes). A GCS that does not answer raises grpc.RpcError."""
    import grpc
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

    with grpc.insecure_channel(gcs_address) as channel:
        try:
            gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel).GetAllNodeInfo(
                gcs_service_pb2.GetAllNodeInfoRequest(), timeout=timeout_s)
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.UNAUTHENTICATED:
                return True
            raise
    return False


def check_ray_auth(insecure_ray: bool, alive_hosts: int, gcs_address: str) -> None:
    """A Ray of several hosts must authenticate its callers (the cluster secret travels in actor
    arguments, and Ray runs any task it is sent) unless the spec says `insecure_ray: true`.
    ValueError naming both ways out otherwise."""
    import grpc

    if alive_hosts < 2 or insecure_ray:
        return
    try:
        if ray_requires_token(gcs_address):
            return
    except grpc.RpcError as err:
        raise ValueError(f"cannot ask the Ray cluster at {gcs_address} whether it authenticates its callers: "
                         f"{err.code().name} {err.details()}") from None
    raise ValueError(f"the Ray cluster at {gcs_address} ({alive_hosts} hosts) takes calls without Ray's token "
                     f"authentication: anyone reaching its ports runs code on every host and reads the cluster "
                     f"secret. Start every node with RAY_AUTH_MODE=token and the same token (`ray start` reads "
                     f"~/.ray/auth_token or RAY_AUTH_TOKEN), or, on a network no one else reaches, set "
                     f"`insecure_ray: true` in the spec")
