"""The request channel's codec: what pickle cost per message, against the typed msgpack
(msgspec) frames that replaced it (transfer/channel_wire.py), on the real message classes.

Each case is one frame's worth of messages as the router and engines exchange them: a
prefill call (16 and 4,096 prompt ids), a streamed delta, a final delta with its transfer
report, a prefill result with its handle. Figures: microseconds to encode and to decode,
bytes, median of --rounds, both codecs in the same run; and what sealing the msgpack frame
adds (transfer/session.py: AES-GCM seal on one end, open on the other).

usage: python -m pdcluster.bench.channel_codec [--rounds 5]
"""

from __future__ import annotations

import argparse
import pickle
import statistics
import time

from pdcluster.proto.messages import (
    DecodeDelta,
    EngineTimes,
    PrefillRequest,
    PrefillResult,
    SamplingSpec,
    TransferStats,
)
from pdcluster.transfer.channel_wire import ENGINE_INBOX, ROUTER_INBOX, DecodeReply, PrefillCall, PrefillReply, _encode
from pdcluster.transfer.session import FrameSeal


def cases() -> dict[str, tuple[list, object]]:
    """name -> (one frame's messages, the decoder its receiver uses)."""
    sampling = SamplingSpec(max_tokens=32)
    handle = {"engine_id": "c-prefill-0", "address": "10.0.0.2:18600", "transfer_id": "cmpl-abc-1",
              "num_tokens": 4096, "transport": "grpc"}
    final = DecodeDelta(list(range(32)), "length", TransferStats(0, 4096, (32,), (1 << 20,), None, 1, 2, 3), 4096,
                        EngineTimes(1, 2, 3), tuple(range(32)))
    return {
        "prefill call, 16 ids": ([PrefillCall(1, PrefillRequest("cmpl-abc", list(range(16)), sampling, "t"))],
                                 ENGINE_INBOX),
        "prefill call, 4,096 ids": ([PrefillCall(1, PrefillRequest("cmpl-abc", list(range(4096)), sampling, "t"))],
                                    ENGINE_INBOX),
        "streamed delta": ([DecodeReply(1, DecodeDelta([5], token_ns=(123456789,)), False)], ROUTER_INBOX),
        "final delta": ([DecodeReply(1, final, True)], ROUTER_INBOX),
        "prefill result": ([PrefillReply(1, PrefillResult("cmpl-abc", handle, 4096, 3968, EngineTimes(1, 2, 3)),
                                         True)], ROUTER_INBOX),
    }


def _us(fn, n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e6


def measure(messages: list, decoder, n: int) -> dict[str, float]:
    pickled, packed = pickle.dumps(messages, protocol=5), _encode(messages)
    assert decoder.decode(packed) == messages, "the codec does not round-trip this frame"
    sealer, opener = FrameSeal(bytes(32)), FrameSeal(bytes(32))  # one connection's direction: counters in step

    def seal_open():
        opener.open(sealer.seal(packed))

    return {"seal+open": _us(seal_open, n),"pickle enc": _us(lambda: pickle.dumps(messages, protocol=5), n),
            "pickle dec": _us(lambda: pickle.loads(pickled), n),
            "msgpack enc": _us(lambda: _encode(messages), n),
            "msgpack dec": _us(lambda: decoder.decode(packed), n),
            "pickle B": len(pickled), "msgpack B": len(packed)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    print("| frame | pickle enc+dec us | msgpack enc+dec us | ratio | seal+open us | pickle B | msgpack B |")
    print("|---|---|---|---|---|---|---|")
    for name, (messages, decoder) in cases().items():
        n = 500 if "4,096" in name else 5000
        runs = [measure(messages, decoder, n) for _ in range(a.rounds)]
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        old, new = med["pickle enc"] + med["pickle dec"], med["msgpack enc"] + med["msgpack dec"]
        print(f"| {name} | {old:.2f} | {new:.2f} | {new / old:.2f} | {med['seal+open']:.2f} | {med['pickle B']:.0f} "
              f"| {med['msgpack B']:.0f} |")


if __name__ == "__main__":
    main()
