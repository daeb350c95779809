"""What an instance's start-up error says: busy ports by spec field, the engine core's own exception."""

from __future__ import annotations

import socket

import pytest

from pdcluster.cluster.instance_plan import plan_instance
from pdcluster.cluster.start_diagnosis import (
    ListenPort,
    PortInUse,
    check_ports_free,
    engine_core_cause,
    listen_ports,
    own_stderr_tail,
)
from pdcluster.proto.kv_event_wire import engine_kv_events_config
from pdcluster.proto.spec import parse_spec


def spec(connector: str = "pdc"):
    return parse_spec({"name": "c", "model": {"path": "/m"}, "prefill": {"instances": 2},
                       "decode": {"instances": 2}, "transfer": {"base_port": 19000, "connector": connector},
                       "router": {"kv_events_port": 19100}})


def test_listen_ports_are_the_ports_the_engine_is_given():
    s = spec()
    assert listen_ports(s, "prefill", 1, "10.0.0.5") == [ListenPort("10.0.0.5", 19102, "router.kv_events_port"),
                                                          ListenPort("10.0.0.5", 19103, "router.kv_events_port"),
                                                          ListenPort("10.0.0.5", 19001, "transfer.base_port")]
    assert {p.host for p in listen_ports(s, "decode", 0)} == {"127.0.0.1"}  # loopback unless told
    assert [p.port for p in listen_ports(s, "decode", 0)] == [19104, 19105]  # D serves no KV
    events = engine_kv_events_config(s, "decode", 1, "10.0.0.5")
    assert (events["endpoint"], events["replay_endpoint"]) == ("tcp://10.0.0.5:19106", "tcp://10.0.0.5:19107")
    for role, index in (("prefill", 1), ("decode", 1)):
        n = spec("nixl")
        assert listen_ports(n, role, index)[-1].port == plan_instance(n, role, index).kv_port
    assert listen_ports(spec("nixl"), "decode", 1)[-1].port == 19003  # after the 2 P side channels


def test_a_taken_port_is_named_with_its_spec_field():
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        with pytest.raises(PortInUse, match=rf"127\.0\.0\.1:{taken} \(transfer\.base_port: Address already in use\)"):
            check_ports_free([ListenPort("127.0.0.1", taken, "transfer.base_port")])
    check_ports_free([ListenPort("127.0.0.1", taken, "transfer.base_port")])  # free again once closed


# What a Ray worker's log holds when vLLM's engine core dies while starting (abridged from a real one).
WORKER_LOG = """\
Loading safetensors checkpoint shards: 100% Completed | 1/1 [00:00<00:00, 50.25it/s]
Process EngineCore:
Traceback (most recent call last):
  File "/usr/lib/python3.11/multiprocessing/process.py", line 314, in _bootstrap
  File ".../vllm/distributed/kv_events.py", line 461, in _bind
    sock.bind(endpoint)
zmq.error.ZMQError: Address already in use (addr='tcp://*:18700')
Exception raised in creation task: The actor died because of an error raised in its creation task
  File ".../vllm/v1/engine/utils.py", line 1434, in wait_for_engine_startup
    raise RuntimeError(
RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {'EngineCore': 1}
"""


def test_the_engine_core_cause_is_its_own_exception_not_the_parents():
    assert engine_core_cause(WORKER_LOG) == "zmq.error.ZMQError: Address already in use (addr='tcp://*:18700')"
    earlier_death = "Process EngineCore:\nValueError: an earlier start\n"
    assert engine_core_cause(earlier_death + WORKER_LOG).startswith("zmq.error.ZMQError")  # the last death counts
    assert engine_core_cause(WORKER_LOG.replace("Process EngineCore:", "")) is None  # no engine core died


def test_stderr_is_read_back_only_from_a_file(tmp_path):
    import os

    log_file = tmp_path / "worker.err"
    log_file.write_text("x" * 100 + WORKER_LOG)
    saved = os.dup(2)
    try:
        for target, want in ((str(log_file), WORKER_LOG[-50:]), (os.devnull, "")):
            fd = os.open(target, os.O_RDONLY)
            os.dup2(fd, 2)
            os.close(fd)
            assert own_stderr_tail(max_bytes=50) == want
        r, w = os.pipe()  # a pipe: never read (it would block)
        os.dup2(w, 2)
        assert own_stderr_tail() == ""
        os.close(r), os.close(w)
    finally:
        os.dup2(saved, 2)
        os.close(saved)
