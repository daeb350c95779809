"""How long Ray takes to declare an unreachable host dead (cluster/ray_settings.py), from the
spec's partition_tolerance_s, and read back from a running cluster's system config."""

from __future__ import annotations

import json

import pytest
from test_spec import minimal, spec_error

from pdcluster.cluster.ray_settings import RAY_DEFAULT, FailureDetection
from pdcluster.proto.spec import parse_spec


@pytest.mark.parametrize("tolerance_s", [3.0, 12.0, 30.0, 120.0])
def test_no_host_gone_for_less_than_the_tolerance_is_declared_dead(tolerance_s):
    d = FailureDetection.tolerating(tolerance_s)
    # Checks failing at once (threshold x period) come no sooner than the tolerance, checks that
    # time out (a cut link: threshold x (period + timeout)) within 1.5 times it.
    assert tolerance_s <= d.tolerance_s < tolerance_s + 1
    assert d.bound_s == pytest.approx(1.5 * d.tolerance_s)
    config = d.system_config()
    assert config["health_check_failure_threshold"] * config["health_check_period_ms"] / 1000 == d.tolerance_s
    # A raylet cut from the GCS waits longer than the GCS does before it gives up on itself.
    assert config["gcs_rpc_server_reconnect_timeout_s"] >= max(60, 2 * d.bound_s)


def test_the_setting_reads_back_from_a_clusters_system_config():
    d = FailureDetection.tolerating(12)
    arg = d.ray_start_arg()
    assert arg.startswith("--system-config=")
    assert FailureDetection.of_cluster(json.loads(arg.split("=", 1)[1])) == d
    ray_default = FailureDetection.of_cluster({"object_spilling_config": "..."})  # nothing set: Ray's own
    assert (ray_default.period_ms, ray_default.timeout_ms, ray_default.failure_threshold) == tuple(RAY_DEFAULT.values())
    assert (ray_default.tolerance_s, ray_default.bound_s) == (15.0, 65.0)


def test_the_spec_field_defaults_to_30_s_and_names_a_bad_value():
    assert parse_spec(minimal()).partition_tolerance_s == 30.0
    assert "partition_tolerance_s" in spec_error(minimal(partition_tolerance_s=0))
    assert "partition_tolerance_s" in spec_error(minimal(partition_tolerance_s="a while"))


# ---------------------------------------------------------------- Ray's token authentication


@pytest.fixture
def gcs():
    """A stand-in GCS answering GetAllNodeInfo as a Ray with token auth does (UNAUTHENTICATED to a
    bare call) or without it (the nodes): address -> mode is set per test."""
    from concurrent import futures

    import grpc
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

    mode = {"auth": True}

    class NodeInfo(gcs_service_pb2_grpc.NodeInfoGcsServiceServicer):
        def GetAllNodeInfo(self, request, context):
            if mode["auth"]:
                context.abort(grpc.StatusCode.UNAUTHENTICATED, "InvalidAuthToken: Authentication token is missing")
            return gcs_service_pb2.GetAllNodeInfoReply()

    server = grpc.server(futures.ThreadPoolExecutor(2))
    gcs_service_pb2_grpc.add_NodeInfoGcsServiceServicer_to_server(NodeInfo(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}", mode
    server.stop(0)


def test_a_multi_host_ray_without_token_auth_is_refused_unless_the_spec_says_so(gcs):
    from pdcluster.cluster.ray_settings import check_ray_auth, ray_requires_token

    address, mode = gcs
    assert ray_requires_token(address)
    check_ray_auth(False, 3, address)  # token auth on: fine
    mode["auth"] = False
    assert not ray_requires_token(address)
    with pytest.raises(ValueError, match=r"\(3 hosts\) takes calls without Ray's token authentication.*"
                                         r"RAY_AUTH_MODE=token.*`insecure_ray: true`"):
        check_ray_auth(False, 3, address)
    check_ray_auth(True, 3, address)  # the spec says so
    check_ray_auth(False, 1, "127.0.0.1:1")  # one host: nothing asked (nothing listens there)
    with pytest.raises(ValueError, match="cannot ask the Ray cluster at 127.0.0.1:1 whether it authenticates"):
        check_ray_auth(False, 2, "127.0.0.1:1")
