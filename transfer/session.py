"""What protects a stream socket's payload after the handshake: per-session keys and sealed frames.

The handshake (transfer/auth.py) proves both ends hold the cluster key; alone it would leave
the frames after it open to whoever sits on the path (a relay passes the handshake through,
then reads prompts and injects calls). So both ends derive two session keys from the key and
the handshake's two fresh nonces (`session_keys`: one per direction, new every connection),
and every frame is sealed with AES-256-GCM (`FrameSeal`): the sender's frame counter is the
nonce, so a frame altered, injected, replayed, reordered or taken from another connection
fails to open and the receiver closes the connection. AES-GCM costs ~1 us for a small frame
and ~0.3 ms per MB here (AES-NI), against the router's ~0.3 ms per call.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

TAG_BYTES = 16  # what sealing adds to a frame


class SealError(Exception):
    """A frame that does not open with this session's key at its place in the stream."""


@dataclass(frozen=True, repr=False)
class SessionKeys:
    send: bytes  # seals what this end sends
    recv: bytes  # opens what it receives

    def __repr__(self) -> str:
        return "SessionKeys(<derived in the handshake>)"


def session_keys(key: bytes, nonce_s: bytes, nonce_c: bytes, server: bool) -> SessionKeys:
    """The keys of one connection, from the cluster key and both handshake nonces."""
    def one(direction: bytes) -> bytes:
        return hmac.new(key, b"\0".join((b"session", direction, nonce_s, nonce_c)), hashlib.sha256).digest()

    to_client, to_server = one(b"server->client"), one(b"client->server")
    return SessionKeys(to_client, to_server) if server else SessionKeys(to_server, to_client)


class FrameSeal:
    """One direction of a session: seals (or opens) its frames in order.

    Invariant: `_count` is the number of frames sealed (opened) so far, and the nonce of the
    next one; a nonce is never used twice with one key (a connection's keys die with it)."""

    def __init__(self, key: bytes):
        self._aead = AESGCM(key)
        self._count = 0

    def _nonce(self) -> bytes:
        nonce = self._count.to_bytes(12, "big")
        self._count += 1
        return nonce

    def seal(self, plain: bytes) -> bytes:
        return self._aead.encrypt(self._nonce(), plain, None)

    def open(self, sealed: bytes | memoryview) -> bytes:
        try:
            return self._aead.decrypt(self._nonce(), sealed, None)
        except InvalidTag:
            raise SealError("a frame that does not authenticate (altered, injected, replayed or out of order: "
                            "someone on the path, or not this session's peer)") from None
