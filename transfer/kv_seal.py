"""Sealed KV bytes on the gRPC data plane (spec `transfer.encrypt`).

The KV service authenticates every call (grpc_auth.py) but sends the blocks in clear: someone on
the path reads the prompts' keys and values. With sealing, D sends 16 random bytes in its
ReadBlocks request (`seal`, covered by the call's token), and both ends derive the stream's key
from them and the cluster secret; P encrypts each chunk's bytes with AES-256-GCM, the chunk's
header as associated data and the chunk's position in the stream as nonce, so a relay can
neither read, alter, reorder, replay nor drop a chunk unseen (D counts every block it planned).

Costs one more copy a side (encrypting and decrypting are the copies) and the cipher's time:
bench/README.md "Sealed KV".
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
from collections.abc import Sequence

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from pdcluster.transfer.auth import derive

NONCE_BYTES = 16  # D's per-stream randomness
TAG_BYTES = 16
_POSITION = struct.Struct(">4xQ")  # a chunk's 12-byte GCM nonce: its index in the stream


class SealError(Exception):
    """A sealed chunk did not open: altered, out of order, or sealed under another key."""


def kv_seal_key(secret: str) -> bytes:
    return derive(secret, "kv-data-seal")


def new_stream_nonce() -> bytes:
    return os.urandom(NONCE_BYTES)


class StreamSeal:
    """One ReadBlocks stream's sealing, either end: chunk k is sealed and opened with nonce k.

    Invariant: `_next` is the index of the next chunk this end seals or opens; each index is
    used once under the stream's key (a new stream, a new key)."""

    def __init__(self, key: bytes, stream_nonce: bytes):
        if len(stream_nonce) != NONCE_BYTES:
            raise SealError(f"a stream's seal nonce is {NONCE_BYTES} bytes, not {len(stream_nonce)}")
        self._key = hmac.new(key, stream_nonce, hashlib.sha256).digest()
        self._next = 0

    def _mode(self, tag: bytes | None = None) -> Cipher:
        nonce = _POSITION.pack(self._next)
        self._next += 1
        return Cipher(algorithms.AES(self._key), modes.GCM(nonce, tag))

    def seal(self, head: bytes, parts: Sequence[memoryview | bytes]) -> bytes:
        """head + the parts encrypted in order + the tag: one frame, the parts copied once."""
        enc = self._mode().encryptor()
        enc.authenticate_additional_data(head)
        out = [head, *(enc.update(p) for p in parts)]
        out.append(enc.finalize())
        out.append(enc.tag)
        return b"".join(out)

    def open(self, head: memoryview, sealed: memoryview) -> bytes:
        """The chunk's bytes, or SealError."""
        if len(sealed) < TAG_BYTES:
            raise SealError(f"a sealed chunk of {len(sealed)} bytes has no room for its tag")
        dec = self._mode(bytes(sealed[-TAG_BYTES:])).decryptor()
        dec.authenticate_additional_data(head)
        try:
            return dec.update(sealed[:-TAG_BYTES]) + dec.finalize()
        except InvalidTag:
            raise SealError(f"chunk {self._next - 1} of the stream did not open: altered, out of order, "
                            "or sealed under another key") from None
