"""FTAR over real loopback sockets, rings as threads of this process: results, reuse, errors."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fthsdp.worker.ftar import (
    FatalFtarError,
    FtarAbortedError,
    FtarConfig,
    FtarEpochMismatchError,
    FtarError,
    FtarLayoutMismatchError,
    FtarRing,
    RecoverableFtarError,
)
from tests.integration.test_ftar_support import (
    FAST,
    exchange,
    ftar_threads,
    open_fds,
    reconfigure_all,
    ring_set,
    wait_for,
)

TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1e-2, 1e-2), torch.float16: (2e-3, 2e-3)}
_RINGS: dict[int, list[FtarRing]] = {}


@pytest.fixture(scope="module")
def rings_by_size() -> Iterator[dict[int, list[FtarRing]]]:
    """Rings of 1..5 members, built once: hypothesis examples reuse them (steady state)."""
    for n in range(1, 6):
        _RINGS[n] = [FtarRing(FAST) for _ in range(n)]
        reconfigure_all(_RINGS[n], epoch=1)
    yield _RINGS
    for rings in _RINGS.values():
        for r in rings:
            r.close()
    _RINGS.clear()


@st.composite
def exchanges(draw: st.DrawFn) -> tuple[int, list[tuple[int, ...]], torch.dtype, list[bool], int]:
    n = draw(st.integers(1, 5))
    shapes = draw(
        st.lists(
            st.lists(st.integers(0, 9), min_size=0, max_size=3).map(tuple), min_size=1, max_size=4
        )
    )
    dtype = draw(st.sampled_from(list(TOL)))
    contribute = draw(st.lists(st.booleans(), min_size=n, max_size=n).filter(any))
    return n, shapes, dtype, contribute, draw(st.integers(0, 2**31))


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(case=exchanges())
def test_result_is_the_contributors_mean(
    rings_by_size: dict[int, list[FtarRing]],
    case: tuple[int, list[tuple[int, ...]], torch.dtype, list[bool], int],
) -> None:
    n, shapes, dtype, contribute, seed = case
    rng = np.random.default_rng(seed)
    rings = rings_by_size[n]
    originals = [
        [torch.from_numpy(rng.standard_normal(s)).to(dtype) for s in shapes] for _ in range(n)
    ]
    inputs = []
    for x, c in zip(originals, contribute, strict=True):
        # A non-contributor's input is NaN: the result is finite only if it is never read.
        inputs.append([t.clone() if c else torch.full_like(t, float("nan")) for t in x])
    works = exchange(rings, inputs, contribute=contribute)
    for w in works:
        w.wait(0)
    k = sum(contribute)
    rtol, atol = TOL[dtype]
    for i, shape in enumerate(shapes):
        ref = sum(x[i].double() for x, c in zip(originals, contribute, strict=True) if c) / k
        for member in inputs:
            assert member[i].dtype == dtype
            assert tuple(member[i].shape) == shape
            torch.testing.assert_close(
                member[i].double(), torch.as_tensor(ref, dtype=torch.float64), rtol=rtol, atol=atol
            )
        for member in inputs[1:]:  # I1: every member holds the same bytes
            assert torch.equal(member[i], inputs[0][i])


def test_big_chunks_across_tensor_boundaries() -> None:
    """Default-ish chunk sizes, a tensor list whose chunks straddle tensor boundaries."""
    config = FtarConfig(chunk_bytes=4096, chunks_in_flight=3)
    with ring_set(3, config) as rings:
        gen = torch.Generator().manual_seed(3)
        xs = [[torch.randn(1000, generator=gen), torch.randn(7, 333, generator=gen)] for _ in rings]
        ref = [sum(x[i] for x in xs) / 3 for i in range(2)]
        ins = [[t.clone() for t in x] for x in xs]
        for w in exchange(rings, ins):
            w.wait(0)
        for x in ins:
            for i in range(2):
                torch.testing.assert_close(x[i], ref[i])


def test_steady_state_reuses_connections() -> None:
    with ring_set(3) as rings:
        before = [(r.stats().connects, r.stats().accepts) for r in rings]
        for _ in range(5):
            for w in exchange(rings, [[torch.ones(50)] for _ in rings]):
                w.wait(0)
        assert [(r.stats().connects, r.stats().accepts) for r in rings] == before
        # A new epoch with the same neighbours keeps the sockets too.
        reconfigure_all(rings, epoch=2)
        for w in exchange(rings, [[torch.ones(50)] for _ in rings]):
            w.wait(0)
        assert [(r.stats().connects, r.stats().accepts) for r in rings] == before
        assert all(r.stats().exchanges_ok == 6 for r in rings)
        # New neighbours: exactly the changed connections are rebuilt.
        reconfigure_all(rings, epoch=3, order=[0, 2, 1])
        assert all(r.stats().connects == b[0] + 1 for r, b in zip(rings, before, strict=True))


def test_a_rank_that_knows_only_its_neighbours_addresses_exchanges_correctly() -> None:
    """What each rank of a large job is told (its own and its two neighbours' addresses, the
    rest empty) is all a ring needs; the sum is every member's."""
    rings = [FtarRing(FAST) for _ in range(5)]
    try:
        addresses = [r.address for r in rings]
        n = len(rings)

        def partial(pos: int) -> list[str]:
            near = {(pos - 1) % n, pos, (pos + 1) % n}
            return [a if i in near else "" for i, a in enumerate(addresses)]

        with ThreadPoolExecutor(n) as pool:
            for f in [pool.submit(r.reconfigure, partial(i), i, 1) for i, r in enumerate(rings)]:
                f.result(timeout=30)
        ins = [[torch.full((1000,), float(i))] for i in range(n)]
        for w in exchange(rings, ins):
            w.wait(0)
        for x in ins:
            torch.testing.assert_close(x[0], torch.full((1000,), 2.0))  # mean of 0..4
        # A neighbour's address is never optional.
        with pytest.raises(FatalFtarError):
            rings[0].reconfigure(["", addresses[1], *addresses[2:4], ""], 0, 2)
    finally:
        for r in rings:
            r.close()


def test_one_member_ring_needs_no_network() -> None:
    with ring_set(1) as (ring,):
        x = [torch.full((5,), 6.0), torch.full((2, 2), 3.0, dtype=torch.bfloat16)]
        ring.allreduce(x, num_contributors=1).wait(5)
        assert torch.equal(x[0], torch.full((5,), 6.0))
        assert torch.equal(x[1], torch.full((2, 2), 3.0, dtype=torch.bfloat16))
        y = [torch.full((3,), float("nan"))]
        ring.allreduce(y, contribute=False, num_contributors=1).wait(5)
        assert torch.equal(y[0], torch.zeros(3))
        with pytest.raises(FatalFtarError):  # more contributors than members
            ring.allreduce(x, num_contributors=2)
        assert ring.stats().bytes_sent == 0
        assert ring.stats().exchanges_ok == 2


def test_epoch_mismatch_is_recoverable() -> None:
    with ring_set(2) as (a, b):
        a.reconfigure([a.address, b.address], 0, 2)  # keeps the sockets; b stays at epoch 1
        works = exchange([a, b], [[torch.ones(10)], [torch.ones(10)]])
        for w in works:
            assert isinstance(w.exception(), RecoverableFtarError)
        assert any(isinstance(w.exception(), FtarEpochMismatchError) for w in works)
        # Both rings recover with a common new epoch.
        reconfigure_all([a, b], epoch=3)
        x = [[torch.full((10,), 1.0)], [torch.full((10,), 3.0)]]
        for w in exchange([a, b], x):
            w.wait(0)
        assert torch.equal(x[0][0], torch.full((10,), 2.0))


def test_an_epoch_aborted_before_its_reconfigure_fails_it_at_once() -> None:
    """The watch learnt that a member of epoch 4 is gone before this rank began rebuilding
    its ring for it: the rebuild fails at once (aborted), instead of waiting out the connect
    timeout for a neighbour that never comes (the 5 s FtarTimeoutError); newer epochs work."""
    with ring_set(2) as (a, b):
        a.abort("r1 evicted", epoch=4)
        with pytest.raises(FtarAbortedError, match="epoch 3 was aborted"):
            a.reconfigure([a.address, b.address], 0, 3)
        with pytest.raises(FtarAbortedError, match="epoch 4 was aborted"):
            a.reconfigure([a.address, b.address], 0, 4)
        reconfigure_all([a, b], epoch=5)
        x = [[torch.full((4,), 1.0)], [torch.full((4,), 5.0)]]
        for w in exchange([a, b], x):
            w.wait(0)
        assert torch.equal(x[0][0], torch.full((4,), 3.0))


def test_stale_epoch_handshake_is_refused() -> None:
    with ring_set(2) as (a, b):
        c = FtarRing(FAST)
        try:
            reconfigure_all([a, b], epoch=5, order=[0, 1])
            # c claims to be a's left at epoch 4 < 5: a refuses it as stale.
            with pytest.raises(FtarEpochMismatchError):
                c.reconfigure([c.address, a.address], 0, 4)
        finally:
            c.close()


@pytest.mark.parametrize(
    "other", [torch.ones(11), torch.ones(10, dtype=torch.bfloat16), torch.ones(2, 5)]
)
def test_layout_mismatch_is_fatal(other: torch.Tensor) -> None:
    with ring_set(2) as (a, b):
        works = exchange([a, b], [[torch.ones(10)], [other]])
        errors = [w.exception() for w in works]
        # Whoever reads the other's header first raises the fatal error and drops its links; the
        # other may see that drop first (a recoverable "peer closed"), never a result.
        fatal = [e for e in errors if isinstance(e, FtarLayoutMismatchError)]
        assert fatal, errors
        assert all(isinstance(e, FtarError) for e in errors)
        detector = a if isinstance(errors[0], FtarLayoutMismatchError) else b
        with pytest.raises(FatalFtarError):
            works[0 if detector is a else 1].wait(0)
        with pytest.raises(FatalFtarError):  # the ring is poisoned: the rank must crash
            detector.allreduce([torch.ones(10)], num_contributors=2)


def test_bad_arguments_are_fatal_at_once() -> None:
    with ring_set(2) as (a, _):
        bad_calls = [
            lambda: a.allreduce([], num_contributors=1),
            lambda: a.allreduce([torch.ones(4, dtype=torch.float64)], num_contributors=1),
            lambda: a.allreduce([torch.ones(4, dtype=torch.int32)], num_contributors=1),
            lambda: a.allreduce([torch.ones(4, 4).t()], num_contributors=1),
            lambda: a.allreduce([torch.ones(4)], num_contributors=0),
            lambda: a.allreduce([torch.ones(4)], num_contributors=3),
            lambda: a.allreduce([torch.ones(4).to_sparse()], num_contributors=1),
            lambda: a.reconfigure([a.address, a.address], 0, 2),
            lambda: a.reconfigure(["nonsense"], 0, 2),
            lambda: a.reconfigure([a.address], 1, 2),
            lambda: a.reconfigure([a.address], 0, 0),  # epoch went back
            lambda: a.reconfigure([a.address], 0, 1),  # same epoch, other ring
        ]
        for call in bad_calls:
            with pytest.raises(FatalFtarError):
                call()
        # None of them broke the ring.
        for w in exchange([a, _], [[torch.ones(3)], [torch.ones(3)]]):
            w.wait(0)


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="multiple of 4"):
        FtarConfig(chunk_bytes=6)
    with pytest.raises(ValueError, match="chunk_timeout"):
        FtarConfig(chunk_timeout=timedelta(seconds=5), exchange_timeout=timedelta(seconds=1))


def test_no_fd_or_thread_leak_across_100_reconfigurations() -> None:
    with ring_set(3) as rings:
        reconfigure_all(rings, epoch=2, order=[0, 2, 1])
        fds, threads = open_fds(), ftar_threads()
        for epoch in range(3, 103):
            order = [0, 1, 2] if epoch % 2 else [0, 2, 1]  # every neighbour changes every time
            reconfigure_all(rings, epoch=epoch, order=order)
            if epoch % 10 == 0:
                for w in exchange(rings, [[torch.ones(20)] for _ in rings]):
                    w.wait(0)
        wait_for(lambda: open_fds() <= fds)  # closes may trail the last reconfigure briefly
        assert ftar_threads() == threads
        assert all(r.stats().connects >= 100 for r in rings)
    wait_for(lambda: ftar_threads() == threads - 12)  # 4 per ring, all gone after close
    assert open_fds() < fds
