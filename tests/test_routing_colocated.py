"""No disaggregation (router.local_prefill.policy always, prefill.instances 0): D is picked as P
would be and prefills every request itself; the spec allows it on the virtual clock only."""

from __future__ import annotations

import contextlib

import pytest
from test_routing import BS, Clock, HeldBlocks, Inst, family

from pdcluster.proto.router_spec import LocalPrefillSpec
from pdcluster.proto.spec import SpecError, parse_spec
from pdcluster.router.pending_blocks import PendingBlocks
from pdcluster.router.routing import InstancePicker


def colocated(held: HeldBlocks, n_d: int = 3, prefill: tuple[str, ...] = ()) -> InstancePicker:
    return InstancePicker("prefix_aware", [Inst(p) for p in prefill], [Inst(f"d{i}") for i in range(n_d)], BS,
                          held, pending=PendingBlocks(), clock=Clock(), local=LocalPrefillSpec(policy="always"))


def test_every_request_goes_to_the_d_holding_its_prefix_which_is_its_p_too():
    held = HeldBlocks()
    prompt = family(1, n=24)
    held.store("d2", prompt[:16])
    pk = colocated(held)
    route = pk.pick(prompt, 4)
    assert route.decode.name == route.prefill.name == "d2" and route.local_prefill
    assert route.local.reason == "always" and route.local.remainder_tokens == 8
    assert route.predicted_d_hit_tokens == 16 and route.predicted_p_hit_tokens is None
    # Even a long remainder, even with a P there: always D.
    assert colocated(HeldBlocks(), prefill=("p0",)).pick(family(2, n=64), 4).local.reason == "always"


def test_a_burst_of_a_new_family_queues_behind_its_first_prefill_on_one_d():
    pk = colocated(HeldBlocks())
    with contextlib.ExitStack() as running:
        routes = []
        for k in range(3):
            routes.append(pk.pick(family(5, n=16, suffix=k), 4))  # 12 shared, 4 its own
            running.enter_context(pk.prefilling_locally(routes[-1]))
        # The first's blocks are pending on its D: the others go there and hit them.
        assert len({r.decode.name for r in routes}) == 1
        assert [r.predicted_d_hit_tokens for r in routes] == [0, 12, 12]
    assert pk._load[routes[0].decode.name].seconds == 0 and pk._load[routes[0].decode.name].local == 0
    pk.pending.check_integrity()


def spec(**roles) -> dict:
    return {"name": "x", "model": {"path": "/nonexistent"}, "engine": {"kind": "sim"},
            "sim": {"params": "tiny-qwen3-cpu"}, "router": {"local_prefill": {"policy": "always"}}, **roles}


def test_the_spec_takes_no_p_only_with_every_prefill_on_d_and_only_simulated():
    s = parse_spec(spec(prefill={"instances": 0}, decode={"instances": 4}))
    assert (s.prefill.instances, s.decode.instances) == (0, 4)
    never = spec(prefill={"instances": 0})
    never["router"]["local_prefill"]["policy"] = "never"
    with pytest.raises(SpecError, match="prefill.instances: 0 leaves nobody to prefill"):
        parse_spec(never)
    real = spec(prefill={"instances": 0})
    real["engine"] = {"kind": "vllm"}
    del real["sim"]
    with pytest.raises(SpecError, match="modelled on the virtual clock only"):
        parse_spec(real)
    with pytest.raises(SpecError, match="decode.instances: at least 1"):
        parse_spec(spec(decode={"instances": 0}))


def test_pdc_up_refuses_a_spec_without_p_before_it_starts_anything(tmp_path, capsys):
    import yaml

    from pdcluster.cluster.cli import main

    path = tmp_path / "d4.yaml"
    path.write_text(yaml.safe_dump(spec(prefill={"instances": 0}, decode={"instances": 4})))
    with pytest.raises(SystemExit) as err:
        main(["up", str(path)])
    assert err.value.code == 2 and "runs on the virtual clock only" in capsys.readouterr().err
