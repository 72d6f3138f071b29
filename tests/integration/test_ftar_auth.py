"""FTAR handshake authentication over real loopback sockets: only holders of the job's ring key
join a ring; a raw connection without a valid proof is closed before any of its bytes are used."""

from __future__ import annotations

import contextlib
import dataclasses
import socket
import threading
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
import torch

from fthsdp.worker.ftar import FtarRing, FtarTimeoutError, RecoverableFtarError, auth, wire
from tests.integration.test_ftar_support import FAST, exchange, reconfigure_all, ring_set

KEYED = dataclasses.replace(FAST, auth_key=auth.ring_key("job-a-token"))


def test_rings_with_the_same_key_exchange() -> None:
    with ring_set(3, KEYED) as rings:
        x = [[torch.full((5,), float(i))] for i in range(3)]
        for work in exchange(rings, x):
            work.wait(0)
        assert all(torch.equal(t[0], torch.full((5,), 1.0)) for t in x)


def test_a_member_with_another_key_cannot_form_the_ring() -> None:
    quick = dataclasses.replace(KEYED, connect_timeout=timedelta(seconds=1))
    other = dataclasses.replace(quick, auth_key=auth.ring_key("job-b-token"))
    a, b = FtarRing(quick), FtarRing(other)
    try:
        peers = [a.address, b.address]
        with ThreadPoolExecutor(2) as pool:
            futures = [pool.submit(r.reconfigure, peers, i, 1) for i, r in enumerate((a, b))]
            errors = [f.exception(timeout=30) for f in futures]
        assert all(isinstance(e, FtarTimeoutError) for e in errors), errors
    finally:
        a.close()
        b.close()


def test_a_connection_without_a_valid_proof_is_closed_unread() -> None:
    with ring_set(2, KEYED) as (a, b):
        host, port = a.address.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=5) as sock:
            raw = bytearray(wire.CHALLENGE_SIZE)
            wire.recv_exact(sock, memoryview(raw))
            challenge = wire.Challenge.decode(bytes(raw)).nonce  # a challenge comes first
            # Claims to be a's left neighbour at a newer epoch, with a proof under no key.
            hello = wire.Hello(2, 1, 2, b.address).encode()
            nonce = auth.new_nonce()
            sock.sendall(hello + nonce + auth.hello_proof(b"", challenge, hello, nonce))
            assert sock.recv(64) == b""  # no ACK, nothing at all: the acceptor hangs up
        # The forged HELLO was neither admitted nor parked: the ring still works, on its
        # original connections, and a new epoch still forms.
        x = [[torch.ones(4)], [torch.full((4,), 3.0)]]
        for work in exchange([a, b], x):
            work.wait(0)
        assert torch.equal(x[0][0], torch.full((4,), 2.0))
        reconfigure_all([a, b], epoch=2)


@pytest.mark.parametrize("field", ["key", "challenge", "hello", "nonce"])
def test_a_proof_holds_only_for_its_key_challenge_and_message(field: str) -> None:
    parts = {
        "key": auth.ring_key("t"),
        "challenge": auth.new_nonce(),
        "hello": wire.Hello(1, 0, 2, "h:1").encode(),
        "nonce": auth.new_nonce(),
    }
    proof = auth.hello_proof(**parts)
    auth.check_proof(auth.hello_proof(**parts), proof, "HELLO")
    # Another key, a replay against a new challenge, a changed HELLO or nonce: refused.
    changed = dict(parts, **{field: parts[field] + b"x"})
    with pytest.raises(auth.FtarAuthError) as err:
        auth.check_proof(auth.hello_proof(**changed), proof, "HELLO")
    assert isinstance(err.value, RecoverableFtarError)


def test_ring_keys_differ_by_token_and_stay_out_of_reprs() -> None:
    assert auth.ring_key("a") == auth.ring_key(b"a") != auth.ring_key("b")
    assert "auth_key" not in repr(KEYED) and repr(KEYED.auth_key) not in repr(KEYED)


def test_silent_and_trickling_clients_do_not_keep_the_ring_from_re_forming() -> None:
    """Seen with a probe: the one accept thread read each HELLO with a per-read timeout and no
    overall deadline, so a client sending a byte every few seconds made every reconfigure fail.
    Now each handshake runs on its own under `hello_timeout`."""
    with ring_set(3) as rings:
        # r2 leaves: r1's right neighbour becomes r0, which must accept a new connection.
        strangers = []
        for ring in rings[:2]:
            host, port = ring.address.rsplit(":", 1)
            strangers += [socket.create_connection((host, int(port)), timeout=5) for _ in range(3)]
        stop = threading.Event()

        def trickle(sock: socket.socket) -> None:
            while not stop.wait(0.5):
                with contextlib.suppress(OSError):
                    sock.send(b"\x00")

        threads = [threading.Thread(target=trickle, args=(s,), daemon=True) for s in strangers[::2]]
        for thread in threads:
            thread.start()
        try:
            reconfigure_all(rings[:2], 2)
            works = exchange(rings[:2], [[torch.ones(16)], [torch.full((16,), 3.0)]])
            assert all(w.exception() is None for w in works)
            assert torch.equal(works[0].tensors[0], torch.full((16,), 2.0))
        finally:
            stop.set()
            for sock in strangers:
                sock.close()
