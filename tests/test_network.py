"""transfer/network.py: which address an instance binds and advertises; cluster/placement.py
and settle_spec: the spec the actors get. No Ray, no sockets."""

from __future__ import annotations

import pytest

from pdcluster.cluster.launch import settle_spec
from pdcluster.cluster.placement import (
    NodeView,
    PlacementError,
    check_placement,
    engine_options,
    router_options,
    selects,
)
from pdcluster.proto.spec import SpecError, parse_spec
from pdcluster.transfer.network import AddressError, InstanceAddress, choose_address, settle_mode

IFACES = {"lo": ["127.0.0.1"], "eth0": ["192.168.1.5"], "ib0": ["10.10.0.7", "10.10.1.7"], "down0": []}


def spec(**overrides):
    data = {"name": "c", "model": {"path": "/m"}, "prefill": {"instances": 2}, "decode": {"instances": 1}}
    data.update(overrides)
    return parse_spec(data)


def node(ip: str, **labels) -> NodeView:
    return NodeView(f"id-{ip}", ip, {"ray.io/node-id": f"id-{ip}", **labels})


# -- address selection


def test_one_node_keeps_to_loopback_several_need_the_node_address():
    assert settle_mode("auto", None, None, alive_nodes=1) == "loopback"
    assert settle_mode("auto", None, None, alive_nodes=3) == "node"
    assert settle_mode("auto", "ib0", None, alive_nodes=1) == "node"  # naming an interface means the node's
    assert settle_mode("loopback", None, None, alive_nodes=5) == "loopback"  # what the spec says
    assert choose_address("loopback", "192.168.1.5", IFACES) == InstanceAddress("127.0.0.1", "127.0.0.1")
    assert choose_address("node", "192.168.1.5", IFACES) == InstanceAddress("192.168.1.5", "192.168.1.5")


def test_an_interface_or_a_network_picks_among_the_nodes_addresses():
    assert choose_address("node", "192.168.1.5", IFACES, interface="ib0").advertise == "10.10.0.7"
    assert choose_address("node", "192.168.1.5", IFACES, cidr="10.10.1.0/24").advertise == "10.10.1.7"
    assert choose_address("node", "192.168.1.5", IFACES, cidr="10.10.0.0/16").advertise == "10.10.0.7"  # lowest


def test_bind_all_is_the_only_wildcard_and_still_advertises_one_address():
    a = choose_address("node", "192.168.1.5", IFACES, cidr="10.10.0.0/16", bind_all=True)
    assert a == InstanceAddress("0.0.0.0", "10.10.0.7")
    for mode, kw in (("node", {}), ("node", {"interface": "eth0"}), ("loopback", {})):
        assert choose_address(mode, "192.168.1.5", IFACES, **kw).bind != "0.0.0.0"


def test_a_node_without_the_address_asked_for_is_named():
    with pytest.raises(AddressError, match=r"network.interface: 'ib1' does not exist on node 192.168.1.5 "
                                           r"\(it has: down0 \(no IPv4\), eth0 \(192.168.1.5\)"):
        choose_address("node", "192.168.1.5", IFACES, interface="ib1")
    with pytest.raises(AddressError, match="'down0' has no IPv4 address"):
        choose_address("node", "192.168.1.5", IFACES, interface="down0")
    with pytest.raises(AddressError, match=r"network.cidr: node 192.168.1.5 has no address in 172.16.0.0/12"):
        choose_address("node", "192.168.1.5", IFACES, cidr="172.16.0.0/12")
    with pytest.raises(AssertionError, match="must be settled"):
        choose_address("auto", "192.168.1.5", IFACES)


# -- the spec's network, auth and placement fields


@pytest.mark.parametrize("network, message", [
    ({"interface": "ib0", "cidr": "10.0.0.0/8"}, "interface and cidr both set"),
    ({"mode": "loopback", "cidr": "10.0.0.0/8"}, "mode loopback binds 127.0.0.1"),
    ({"mode": "loopback", "bind_all": True}, "mode loopback binds 127.0.0.1"),
    ({"cidr": "10.0.0.300/8"}, r"network.cidr: '10.0.0.300/8' is not an IPv4 network"),
    ({"mode": "lan"}, "network.mode: Input should be 'auto', 'loopback' or 'node'"),
])
def test_network_errors_name_the_field(network, message):
    with pytest.raises(SpecError, match=message):
        spec(network=network)


def test_transfer_host_is_gone_with_a_pointer_to_network():
    with pytest.raises(SpecError, match=r"transfer: `host` is gone: .* see `network:`"):
        spec(transfer={"host": "10.0.0.1"})


def test_auth_fields_are_checked_and_never_dumped():
    with pytest.raises(SpecError, match="auth.secret: too weak: .* make one with"):
        spec(auth={"secret": "short"})
    with pytest.raises(SpecError, match="auth.api_keys: an API key is empty"):
        spec(auth={"api_keys": [""]})
    s = spec(auth={"secret": "a-secret-of-enough-chars", "api_keys": ["sk-1"]})
    dumped = str(s.model_dump(mode="json"))
    assert "a-secret-of-enough-chars" not in dumped and "sk-1" not in dumped and "**********" in dumped
    assert "a-secret-of-enough-chars" not in repr(s)
    assert s.secret() == "a-secret-of-enough-chars"


def test_placement_per_instance_must_match_the_instances():
    with pytest.raises(SpecError, match=r"prefill: placement.per_instance has 1 entries for 2"):
        spec(prefill={"instances": 2, "placement": {"per_instance": [{"pdc-host": "host1"}]}})
    with pytest.raises(SpecError, match="keys and values must be non-empty"):
        spec(decode={"placement": {"labels": {"pdc-host": ""}}})


# -- placement against the nodes Ray has


NODES = [node("10.213.0.1", **{"pdc-host": "head"}), node("10.213.0.2", **{"pdc-host": "host1"}),
         node("10.213.0.3", **{"pdc-host": "host2"})]


def test_labels_become_label_selectors_and_spread():
    s = spec(prefill={"instances": 2, "placement": {"labels": {"pdc-role": "p"}, "spread": True,
                                                     "per_instance": [{"pdc-host": "host1"}, {"pdc-host": "host2"}]}},
             decode={"placement": {"labels": {"pdc-host": "host2"}}})
    assert engine_options(s, "prefill", 1) == {"label_selector": {"pdc-role": "p", "pdc-host": "host2"},
                                               "scheduling_strategy": "SPREAD"}
    assert engine_options(s, "decode", 0) == {"label_selector": {"pdc-host": "host2"}}
    assert engine_options(spec(), "decode", 0) == {}


def test_a_host_ray_does_not_have_fails_naming_the_field_and_the_nodes():
    s = spec(prefill={"instances": 2, "placement": {"per_instance": [{"pdc-host": "host1"}, {"pdc-host": "host9"}]}})
    with pytest.raises(PlacementError, match=r"prefill.placement.per_instance\[1\]: no Ray node has labels "
                                             r"\{'pdc-host': 'host9'\} \(prefill-1\); the nodes: 10.213.0.1 "
                                             r"\{pdc-host: head\}; 10.213.0.2 \{pdc-host: host1\}"):
        check_placement(s, NODES)
    with pytest.raises(PlacementError, match=r"decode.placement.labels: no Ray node has labels"):
        check_placement(spec(decode={"placement": {"labels": {"gpu": "h200"}}}), NODES)
    with pytest.raises(PlacementError, match=r"router.labels: no Ray node"):
        check_placement(spec(router={"labels": {"pdc-host": "host7"}}), NODES)
    check_placement(spec(decode={"placement": {"labels": {"pdc-host": "host2"}}}), NODES)  # fine


@pytest.mark.parametrize("value, selector, hit", [
    ("host1", "host1", True), ("host1", "host2", False), (None, "host1", False),
    ("host1", "!host2", True), ("host2", "!host2", False), (None, "!host2", True),
    ("host2", "in(host1,host2)", True), ("host3", "in(host1,host2)", False), (None, "in(host1)", False),
    ("host3", "!in(host1,host2)", True), ("host1", "!in(host1,host2)", False),
    ("host2", "in(host1, host2)", False),  # as Ray 2.60 reads it: " host2" (the spec drops the space)
])
def test_selects_reads_rays_label_selector_values(value, selector, hit):
    assert selects(value, selector) is hit


def test_a_selector_with_choices_places_on_any_of_them_and_bad_syntax_names_the_field():
    s = spec(decode={"placement": {"labels": {"pdc-host": "in(host1, host2)"}}})
    check_placement(s, NODES)
    assert engine_options(s, "decode", 0) == {"label_selector": {"pdc-host": "in(host1,host2)"}}  # Ray's way
    with pytest.raises(PlacementError, match=r"decode.placement.labels: no Ray node has labels"):
        check_placement(spec(decode={"placement": {"labels": {"pdc-host": "in(host7, host8)"}}}), NODES)
    with pytest.raises(SpecError, match=r"decode.placement.labels: .*label 'pdc-host': Invalid label selector "
                                        r"value `in\(host1,`"):
        spec(decode={"placement": {"labels": {"pdc-host": "in(host1,"}}})


def test_routers_go_to_the_drivers_node_unless_labelled():
    assert router_options(spec(router={"labels": {"pdc-host": "head"}}), "x") == {
        "label_selector": {"pdc-host": "head"}}
    assert router_options(spec(), "ab" * 28)["scheduling_strategy"].node_id == "ab" * 28


# -- settle_spec: what the actors get


def test_settle_fills_the_secret_from_the_spec_the_env_or_a_new_one():
    one = [node("10.0.0.1")]
    assert settle_spec(spec(auth={"secret": "from-the-spec-0123456789"}), one, {}).secret() == \
        "from-the-spec-0123456789"
    assert settle_spec(spec(), one, {"PDC_CLUSTER_SECRET": "from-the-env-0123456789"}).secret() == \
        "from-the-env-0123456789"
    a, b = settle_spec(spec(), one, {}).secret(), settle_spec(spec(), one, {}).secret()
    assert a != b and len(a) == 64
    with pytest.raises(ValueError, match="PDC_CLUSTER_SECRET: the cluster secret is too weak"):
        settle_spec(spec(), one, {"PDC_CLUSTER_SECRET": "short"})


def test_settle_reads_api_keys_from_the_env_and_decides_the_network():
    one, three = [node("10.0.0.1")], NODES
    s = settle_spec(spec(), one, {"PDC_API_KEYS": "k1,k2"})
    assert [k.get_secret_value() for k in s.auth.api_keys] == ["k1", "k2"]
    assert s.network.mode == "loopback" and settle_spec(spec(), three, {}).network.mode == "node"
    kept = settle_spec(spec(auth={"api_keys": ["mine"]}), one, {"PDC_API_KEYS": "k1"})
    assert [k.get_secret_value() for k in kept.auth.api_keys] == ["mine"]
    with pytest.raises(PlacementError):
        settle_spec(spec(decode={"placement": {"labels": {"pdc-host": "nowhere"}}}), three, {})
