"""Who may join a ring: a challenge-response on every FTAR connection, keyed by the job's secret.

Gradients are averaged into the model, so a connection must prove it belongs to the job before
any of its bytes are used. On accept, the acceptor sends a fresh random challenge; the connector
answers with HELLO, its own nonce and HMAC-SHA256(key, "hello" | challenge | HELLO | nonce); the
acceptor checks it (constant time) and answers ACK with HMAC-SHA256(key, "ack" | nonce | ACK).
Each side's proof covers the other side's fresh nonce, so a recorded handshake cannot be
replayed, and neither side trusts a peer that does not hold the key. The key is derived from
the job's bearer token, never sent. (Like the bearer tokens of the services, this authenticates
peers; it does not encrypt the data stream: run rings on a trusted network.)"""

from __future__ import annotations

import hashlib
import hmac
import secrets

from fthsdp.worker.ftar.errors import FtarPeerError

__all__ = [
    "MAC_BYTES",
    "NONCE_BYTES",
    "FtarAuthError",
    "ack_proof",
    "check_proof",
    "hello_proof",
    "new_nonce",
    "ring_key",
]

NONCE_BYTES = 16
MAC_BYTES = hashlib.sha256().digest_size
_LABEL = b"fthsdp-ftar-ring-key-v1"


class FtarAuthError(FtarPeerError):
    """A peer's handshake proof is wrong: it does not hold the job's ring key."""


def ring_key(secret: str | bytes) -> bytes:
    """The ring key of a job, from its shared secret (the bearer token)."""
    raw = secret.encode() if isinstance(secret, str) else secret
    return hmac.new(raw, _LABEL, hashlib.sha256).digest()


def new_nonce() -> bytes:
    """A fresh random challenge or nonce."""
    return secrets.token_bytes(NONCE_BYTES)


def hello_proof(key: bytes, challenge: bytes, hello: bytes, nonce: bytes) -> bytes:
    """The connector's proof: binds its HELLO and nonce to the acceptor's challenge."""
    return hmac.new(key, b"hello" + challenge + hello + nonce, hashlib.sha256).digest()


def ack_proof(key: bytes, nonce: bytes, ack: bytes) -> bytes:
    """The acceptor's proof: binds its ACK to the connector's nonce."""
    return hmac.new(key, b"ack" + nonce + ack, hashlib.sha256).digest()


def check_proof(expected: bytes, received: bytes, what: str) -> None:
    """Raises `FtarAuthError` unless the proofs match (constant-time comparison)."""
    if not hmac.compare_digest(expected, received):
        raise FtarAuthError(f"bad {what} proof: the peer does not hold this job's ring key")
