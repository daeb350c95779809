"""The cluster's instances, kept where a router that Ray restarts finds them (Ray's internal KV, in
the GCS): the launcher that handed them to the first router may be long gone (router/server.py)."""

from __future__ import annotations

from pdcluster.proto.messages import InstanceInfo
from pdcluster.proto.names import NAMESPACE
from pdcluster.proto.spec import ClusterSpec


def _instances_key(spec: ClusterSpec) -> bytes:
    return f"pdc-instances/{spec.name}".encode()


def remember_instances(spec: ClusterSpec, infos: list[InstanceInfo]) -> None:
    """Keep the cluster's instances where a router Ray restarts finds them (Ray's internal KV,
    in the GCS): the launcher that handed them over may be long gone."""
    import msgspec
    from ray.experimental.internal_kv import _internal_kv_put

    _internal_kv_put(_instances_key(spec), msgspec.json.encode(infos), overwrite=True, namespace=NAMESPACE)


def recall_instances(spec: ClusterSpec) -> list[InstanceInfo]:
    import msgspec
    from ray.experimental.internal_kv import _internal_kv_get

    data = _internal_kv_get(_instances_key(spec), namespace=NAMESPACE)
    assert data is not None, f"no instances kept for cluster {spec.name}: a router restarted before any started"
    return msgspec.json.decode(data, type=list[InstanceInfo])
