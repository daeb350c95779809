"""Sealed KV on the gRPC data plane (transfer/kv_seal.py, spec transfer.encrypt, issue 26 item 2):
the chunk's bytes leave P encrypted and authenticated, open only in order under the stream's key,
and a P that seals refuses a D asking in clear."""

from __future__ import annotations

import logging

import pytest
import torch
from test_spec import minimal
from transfer_fakes import (
    LAYERS,
    SECRET,
    block,
    make_job,
    offer,
    wait_results,
)

from pdcluster.proto.spec import parse_spec
from pdcluster.transfer import frames
from pdcluster.transfer import kv_transfer_pb2 as pb
from pdcluster.transfer.kv_seal import SealError, StreamSeal, kv_seal_key, new_stream_nonce

KEY = kv_seal_key(SECRET)
MARK = b"prompt-kv-bytes!" * 64  # what a block holds, recognisable on the wire


def ends(nonce: bytes | None = None) -> tuple[StreamSeal, StreamSeal]:
    nonce = nonce or new_stream_nonce()
    return StreamSeal(KEY, nonce), StreamSeal(KEY, nonce)


def test_a_sealed_frame_hides_its_bytes_and_opens_whole_in_order():
    p, d = ends()
    chunks = [pb.KvChunk(layer="l", group=0, first=k, count=1) for k in range(3)]
    sealed = [frames.encode(c, [memoryview(MARK[:512]), memoryview(MARK[512:])], p) for c in chunks]
    assert all(MARK[:64] not in s for s in sealed)  # a relay reads no KV
    for k, s in enumerate(sealed):
        f = frames.decode(s)
        assert f.chunk.first == k and d.open(f.head, f.data) == MARK


@pytest.mark.parametrize("attack", ["flip a byte", "alter the header", "reorder", "replay", "another stream",
                                    "truncate"])
def test_a_relay_can_neither_alter_reorder_replay_nor_move_a_chunk(attack):
    p, d = ends()
    first, second = (frames.encode(pb.KvChunk(layer="l", first=k, count=1), [memoryview(MARK)], p) for k in (0, 1))
    if attack == "flip a byte":
        bad = bytearray(first)
        bad[-100] ^= 1
        frames_in = [bytes(bad)]
    elif attack == "alter the header":  # first=0 -> first=1: the blocks would land elsewhere
        frames_in = [first.replace(pb.KvChunk(layer="l", first=0, count=1).SerializeToString(),
                                   pb.KvChunk(layer="l", first=1, count=1).SerializeToString())]
    elif attack == "reorder":
        frames_in = [second]
    elif attack == "replay":
        assert d.open(frames.decode(first).head, frames.decode(first).data) == MARK
        frames_in = [first]
    elif attack == "another stream":
        d = StreamSeal(KEY, new_stream_nonce())
        frames_in = [first]
    else:
        frames_in = [first[:30]]
    with pytest.raises(SealError):
        f = frames.decode(frames_in[0])
        d.open(f.head, f.data)


def test_a_stream_nonce_of_another_length_is_refused():
    with pytest.raises(SealError, match="16 bytes, not 3"):
        StreamSeal(KEY, b"abc")


def test_a_sealed_pull_in_many_chunks_is_exact(make_p, make_d):
    p, d = make_p(chunk_bytes=4096, require_seal=True), make_d(seal=True)
    offer(p, "r1", (2, 5, 7, 9))
    d.fetcher.submit(make_job(p.server.address, (0, 1, 2, 3), (3, 4, 8, 15)))
    assert wait_results(d.fetcher, {"d-r1"}).failed == set()
    for name in LAYERS:
        for pb_id, lb in zip((2, 5, 7, 9), (3, 4, 8, 15)):
            assert torch.equal(block(d.caches[name], d.block_dim, lb), block(p.caches[name], p.block_dim, pb_id))


def test_a_p_that_seals_refuses_a_d_asking_in_clear(make_p, make_d, caplog):
    p, d = make_p(chunk_bytes=4096, require_seal=True), make_d()
    offer(p, "r1", (2, 5))
    caplog.set_level(logging.WARNING)
    d.fetcher.submit(make_job(p.server.address, (0, 1), (3, 4)))
    assert wait_results(d.fetcher, {"d-r1"}).failed == {"d-r1"}
    assert "sends KV sealed only (transfer.encrypt)" in caplog.text
    assert not d.caches[LAYERS[0]].any()  # nothing written


def test_the_spec_option_is_for_the_grpc_backend_of_the_projects_connector():
    assert parse_spec(minimal(transfer={"encrypt": True})).transfer.encrypt
    for transfer in ({"encrypt": True, "backend": "torch_dist"}, {"encrypt": True, "connector": "nixl"}):
        with pytest.raises(ValueError, match="would send it in clear"):
            parse_spec(minimal(transfer=transfer))


def test_the_option_reaches_both_ends_connector_settings(tmp_path):
    from test_vllm_patches import model_dir, spec

    from pdcluster.cluster.instance_plan import plan_instance
    from pdcluster.transfer.connector_meta import ConnectorSettings

    model = model_dir(tmp_path / "m", "Qwen3ForCausalLM")
    for encrypt in (True, False):
        for role in ("prefill", "decode"):
            plan = plan_instance(spec(model, transfer={"base_port": 19000, "encrypt": encrypt}), role, 0)
            extra = plan.engine_args["kv_transfer_config"]["kv_connector_extra_config"]
            assert ConnectorSettings.from_extra(extra).encrypt is encrypt
