"""FTAR under faults: abort, timeouts, a peer process killed with SIGKILL mid-exchange.

This module doubles as the peer program: ``python -m tests.integration.test_ftar_faults`` runs one
ring member in its own process, driven over stdin.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from fthsdp.worker.ftar import (
    FtarAbortedError,
    FtarConfig,
    FtarEpochMismatchError,
    FtarPeerError,
    FtarRing,
    FtarTimeoutError,
    RecoverableFtarError,
)
from tests.integration.test_ftar_support import FAST, exchange, reconfigure_all, ring_set, wait_for

ROOT = Path(__file__).resolve().parents[2]


def test_abort_unblocks_a_stuck_exchange_fast() -> None:
    with ring_set(3) as (a, b, _c):
        x = [torch.ones(1000)]
        work = a.allreduce(x, num_contributors=3)
        b.allreduce([torch.ones(1000)], num_contributors=3)  # c never joins: the ring stalls
        wait_for(lambda: a.stats().bytes_sent > 0)  # a is mid-exchange, blocked on c
        a.abort("membership changed")
        # Aborted, not timed out: the wait (5 s) is half the exchange timeout (10 s), and the
        # ring's own bound would raise FtarTimeoutError. How fast (target 100 ms): bench/ftar.py.
        with pytest.raises(FtarAbortedError):
            work.wait(timeout=5)
        # Work queued after the abort fails at once, until reconfigure.
        assert isinstance(a.allreduce(x, num_contributors=3).exception(), FtarAbortedError)
        b.abort()
        reconfigure_all([a, b], epoch=2)
        y = [[torch.full((1000,), 2.0)], [torch.full((1000,), 4.0)]]
        for w in exchange([a, b], y):
            w.wait(0)
        assert torch.equal(y[0][0], torch.full((1000,), 3.0))


def test_abort_fails_queued_work_and_unblocks_reconfigure() -> None:
    with ring_set(2) as (a, b):
        works = [a.allreduce([torch.ones(8)], num_contributors=2) for _ in range(3)]
        a.abort()
        for w in works:
            with pytest.raises(FtarAbortedError):
                w.wait(timeout=5)
        # b reconfigures toward a ring whose other member never shows up; abort unblocks it.
        c = FtarRing(FAST)
        try:
            errors: list[BaseException] = []

            def join() -> None:
                try:
                    b.reconfigure([b.address, c.address], 0, 7)
                except BaseException as exc:
                    errors.append(exc)

            t = threading.Thread(target=join)
            t.start()
            wait_for(lambda: b.stats().connects > 1)  # connected to c, which never answers
            b.abort()
            t.join(timeout=2)
            assert not t.is_alive()
            assert len(errors) == 1
            assert isinstance(errors[0], FtarAbortedError)
        finally:
            c.close()


def test_same_epoch_repair_rebuilds_only_broken_links() -> None:
    """The Manager's rule: reconfigure only if the epoch changed or ``ring.broken``."""
    with ring_set(4) as rings:
        a, b, c, d = rings
        for w in exchange(rings, [[torch.ones(64)] for _ in rings]):
            w.wait(0)
        a.abort("local trouble")  # closes a's links: b (its right) and d (its left) see EOF
        wait_for(lambda: b.broken and d.broken)
        assert a.broken
        assert not c.broken
        peers = [r.address for r in rings]
        needy = [(i, r) for i, r in enumerate(rings) if r.broken]
        assert [i for i, _ in needy] == [0, 1, 3]
        # a gave up epoch 1: until its own reconfigure, its left neighbour d is told so at once.
        with pytest.raises(FtarEpochMismatchError, match="gave up epoch 1"):
            d.reconfigure(peers, 3, 1)
        connects = a.stats().connects
        threads = [threading.Thread(target=r.reconfigure, args=(peers, i, 1)) for i, r in needy]
        threads[0].start()
        wait_for(lambda: a.stats().connects > connects)  # a is back in epoch 1: it admits d
        for t in threads[1:]:
            t.start()
        for t in threads:
            t.join(timeout=20)
        assert not any(r.broken for r in rings)
        xs = [[torch.full((64,), float(i))] for i in range(4)]
        for w in exchange(rings, xs):
            w.wait(0)
        assert all(torch.equal(x[0], torch.full((64,), 1.5)) for x in xs)


def test_a_rank_whose_exchange_failed_refuses_its_epoch_at_once() -> None:
    """A neighbour that reconfigures late into an epoch whose exchange already failed here is
    told so at once (its replica votes no and asks for a new quorum) instead of being admitted
    into an exchange nobody joins until a timeout (the health service named such a rank hung)."""
    config = FtarConfig(
        chunk_bytes=64,
        chunk_timeout=timedelta(milliseconds=200),
        exchange_timeout=timedelta(milliseconds=400),
        connect_timeout=timedelta(seconds=30),
    )
    with ring_set(3, config) as (a, b, c):
        with pytest.raises(FtarTimeoutError):
            a.allreduce([torch.ones(100)], num_contributors=3).wait(timeout=5)
        c.abort("c was still in an older exchange")  # so it reconnects, as a late rank does
        peers = [r.address for r in (a, b, c)]
        started = time.monotonic()
        with pytest.raises(FtarEpochMismatchError, match="gave up epoch 1"):
            c.reconfigure(peers, 2, 1)  # c connects to its right neighbour, a
        # The bound is the property: told at once, not after the connect timeout (30 s).
        assert time.monotonic() - started < 15.0
        # The new quorum's epoch is admitted as always, and the ring works again.
        b.abort()
        reconfigure_all([a, b, c], epoch=2)
        xs = [[torch.full((100,), float(i))] for i in range(3)]
        for w in exchange([a, b, c], xs):
            w.wait(0)
        assert all(torch.equal(x[0], torch.full((100,), 1.0)) for x in xs)


def test_a_connection_kept_at_one_end_and_dropped_at_the_other_fails_the_epoch_at_both() -> None:
    """Epoch 2 turns the ring a, b, c into a, b. a keeps its connection to b (its right in
    both rings) an instant before b aborts epoch 1 (its watch saw c go) and drops it. a's
    exchange fails on the dropped connection, and b, waiting for a to connect as its left
    (a never will: it kept one), learns it from its own right connection, to a, closing: it
    fails epoch 2 at once, recoverably, instead of waiting out the connect timeout while the
    quorum waits for b to ask. (A 2 s stall of the survivors in the overlapping-failures demo.)
    Epoch 3 then works."""
    config = FtarConfig(
        chunk_bytes=64,
        chunk_timeout=timedelta(seconds=5),
        exchange_timeout=timedelta(seconds=10),
        connect_timeout=timedelta(seconds=120),
    )
    with ring_set(3, config) as (a, b, c), ThreadPoolExecutor(2) as pool:
        peers = [a.address, b.address]
        a_joined = pool.submit(a.reconfigure, peers, 0, 2)
        wait_for(lambda: a.epoch == 2)  # a has kept its right connection and awaits b
        b.abort("c evicted")
        b_joined = pool.submit(b.reconfigure, peers, 1, 2)
        a_joined.result(timeout=30)  # b connected to a, as a's left
        work = a.allreduce([torch.ones(100)], num_contributors=2)
        wait_for(work.done, 30)
        assert isinstance(work.exception(), RecoverableFtarError), work.exception()
        # Failed by the closed connection, well before the connect timeout (120 s).
        with pytest.raises(FtarPeerError, match="closed the connection while this rank awaited"):
            b_joined.result(timeout=60)
        c.close()
        reconfigure_all([a, b], epoch=3)
        xs = [[torch.full((100,), 1.0)], [torch.full((100,), 3.0)]]
        for w in exchange([a, b], xs):
            w.wait(0)
        assert all(torch.equal(x[0], torch.full((100,), 2.0)) for x in xs)


def test_silent_peer_times_out_recoverably() -> None:
    config = FtarConfig(
        chunk_bytes=64,
        chunk_timeout=timedelta(milliseconds=200),
        exchange_timeout=timedelta(milliseconds=400),
    )
    with ring_set(2, config) as (a, b):
        started = time.monotonic()
        work = a.allreduce([torch.ones(100)], num_contributors=2)
        # The ring's own bound ended it (not the wait's 5 s), after the exchange timeout: a
        # lower bound no loaded machine can break.
        with pytest.raises(FtarTimeoutError, match="exchange timed out"):
            work.wait(timeout=5)
        assert time.monotonic() - started >= 0.35
        # The failure closed a's sockets; b notices at its next exchange instead of hanging.
        failed = b.allreduce([torch.ones(100)], num_contributors=2)
        with pytest.raises(RecoverableFtarError):
            failed.wait(timeout=5)


def test_wait_timeout_is_recoverable() -> None:
    with ring_set(2) as (a, _):
        work = a.allreduce([torch.ones(4)], num_contributors=2)
        with pytest.raises(FtarTimeoutError):
            work.wait(timeout=0.01)
        assert not work.done()
        a.abort()
        with pytest.raises(FtarAbortedError):
            work.wait(timeout=5)


def test_survivors_recover_after_a_peer_is_killed_mid_exchange() -> None:
    """Ring a -> b -> p -> a; p (a real process) exchanges, then is SIGKILLed mid-way."""
    config = FtarConfig(
        chunk_bytes=64 * 1024,
        chunks_in_flight=2,
        chunk_timeout=timedelta(seconds=5),
        exchange_timeout=timedelta(seconds=10),
    )
    peer = subprocess.Popen(
        [sys.executable, "-m", "tests.integration.test_ftar_faults"],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert peer.stdout is not None
        assert peer.stdin is not None
        p_address = peer.stdout.readline().strip()
        with FtarRing(config) as a, FtarRing(config) as b:
            peers = [a.address, b.address, p_address]
            peer.stdin.write(" ".join(peers) + "\n")
            peer.stdin.flush()
            threads = [
                threading.Thread(target=r.reconfigure, args=(peers, i, 1))
                for i, r in enumerate((a, b))
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=20)
            assert peer.stdout.readline().strip() == "ready"
            gen = torch.Generator().manual_seed(0)
            xa, xb = torch.randn(1 << 20, generator=gen), torch.randn(1 << 20, generator=gen)
            # b does not join yet, so the ring cannot finish; p has really sent a its data.
            work_a = a.allreduce([xa.clone()], num_contributors=3)
            wait_for(lambda: a.stats().bytes_received > 0)
            peer.kill()
            peer.wait(timeout=10)
            work_b = b.allreduce([xb.clone()], num_contributors=3)
            for w in (work_a, work_b):
                with pytest.raises(RecoverableFtarError):
                    w.wait(timeout=8)
            reconfigure_all([a, b], epoch=2)
            ya, yb = [xa.clone()], [xb.clone()]  # retry from the intact originals
            for w in exchange([a, b], [ya, yb]):
                w.wait(0)
            torch.testing.assert_close(ya[0], (xa + xb) / 2)
            assert torch.equal(ya[0], yb[0])
    finally:
        if peer.poll() is None:
            peer.kill()
        peer.wait(timeout=10)
        for pipe in (peer.stdin, peer.stdout):
            if pipe is not None:
                pipe.close()


def _peer_main() -> None:
    """The killed member: joins the ring at position 2, then exchanges until it is killed."""
    config = FtarConfig(chunk_bytes=64 * 1024, chunks_in_flight=2)
    with FtarRing(config) as ring:
        print(ring.address, flush=True)
        peers = sys.stdin.readline().split()
        ring.reconfigure(peers, 2, 1)
        print("ready", flush=True)
        x = torch.randn(1 << 20)
        ring.allreduce([x], num_contributors=3).wait(timeout=60)


if __name__ == "__main__":
    _peer_main()
