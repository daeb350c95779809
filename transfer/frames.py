"""ReadBlocks' responses on the wire: a KvChunk header, then the blocks' raw bytes.

As a protobuf `bytes` field, every chunk of KV would be copied twice more on P
(into the message, then out to the wire) and once more on D (out of the parsed
message). So ReadBlocks is registered with these two functions instead of
KvChunk's own (de)serializer; the other RPCs stay plain protobuf:

    frame = u32 little-endian header length | KvChunk (data empty) | the blocks' bytes

On P the blocks are copied once, from P's cache straight into the frame (one view
per run of consecutive block ids, `PagedKv.byte_runs`), then by gRPC; on D they are
read in place from the received bytes into the paged cache (a copy per run).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

import grpc
import torch

from pdcluster.transfer import kv_transfer_pb2 as pb
from pdcluster.transfer.kv_seal import StreamSeal

READ_BLOCKS = "/pdcluster.transfer.KvTransfer/ReadBlocks"
_LEN = struct.Struct("<I")


@dataclass(frozen=True)
class Frame:
    chunk: pb.KvChunk  # layer, group, first, count, tag (its data field unused)
    data: memoryview  # the blocks' bytes (sealed: and the tag), a view into the received message
                      # (empty over a data channel)
    head: memoryview  # length and header as sent: a sealed frame's associated data


def encode(chunk: pb.KvChunk, blocks: torch.Tensor | Sequence[memoryview] | None = None,
           seal: StreamSeal | None = None) -> bytes:
    """The frame of `chunk` carrying `blocks`: a tensor of them, or their bytes as views in order;
    sealed by the stream's `seal` when given (transfer/kv_seal.py)."""
    header = chunk.SerializeToString()
    head = _LEN.pack(len(header)) + header
    if blocks is None:
        return head
    if isinstance(blocks, torch.Tensor):
        blocks = (memoryview(blocks.contiguous().reshape(-1).view(torch.uint8).numpy()),)
    if seal is not None:
        return seal.seal(head, blocks)
    # join copies each part once, straight into the frame (gRPC takes bytes, not bytearray or memoryview).
    return b"".join((head, *blocks))


def decode(frame: bytes) -> Frame:
    (n,) = _LEN.unpack_from(frame)
    view = memoryview(frame)
    end = _LEN.size + n
    return Frame(pb.KvChunk.FromString(view[_LEN.size:end]), view[end:], view[:end])


def read_blocks_handler(behaviour) -> grpc.RpcMethodHandler:
    """P: ReadBlocks whose generator yields frames (bytes), sent as they are."""
    return grpc.unary_stream_rpc_method_handler(behaviour, request_deserializer=pb.ReadBlocksRequest.FromString,
                                                response_serializer=None)


def framed_stub(channel: grpc.Channel):
    """D: P's stub, whose ReadBlocks call yields Frames."""
    from pdcluster.transfer import kv_transfer_pb2_grpc as pb_grpc

    stub = pb_grpc.KvTransferStub(channel)
    stub.ReadBlocks = channel.unary_stream(READ_BLOCKS, request_serializer=pb.ReadBlocksRequest.SerializeToString,
                                           response_deserializer=decode)
    return stub
