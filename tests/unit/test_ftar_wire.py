"""FTAR's pure parts: config validation, wire framing, the ring plan and flat buffer views."""

from __future__ import annotations

import socket
from datetime import timedelta

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fthsdp.worker.ftar import FatalFtarError, FtarConfig, FtarPeerError, wire
from fthsdp.worker.ftar.engine import FlatBuffer, RingPlan


@pytest.mark.parametrize(
    "kwargs",
    [
        {"chunk_bytes": 0},
        {"chunk_bytes": 10},
        {"chunks_in_flight": 0},
        {"port": 70000},
        {"bind_host": ""},
        {"chunk_timeout": timedelta(0)},
        {"connect_timeout": 5},
        {"chunk_timeout": timedelta(seconds=9), "exchange_timeout": timedelta(seconds=8)},
        {"socket_buffer_bytes": 10},
        {"max_ring_size": 0},
    ],
)
def test_config_rejects_bad_values(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError, match=r"must"):
        FtarConfig(**kwargs)  # type: ignore[arg-type]


def test_config_defaults_are_valid_and_frozen() -> None:
    config = FtarConfig()
    assert config.chunk_elems * 4 == config.chunk_bytes
    with pytest.raises(AttributeError):
        config.chunk_bytes = 8  # type: ignore[misc]


def test_messages_round_trip() -> None:
    header = wire.ExchangeHeader(7, 3, 1, 4, 1000, 16, 3, b"x" * 32, True)
    assert wire.ExchangeHeader.decode(header.encode()) == header
    for code in range(3):  # the ring dtype rides in the flags next to the contribute bit
        for contribute in (False, True):
            h = wire.ExchangeHeader(7, 3, 1, 4, 1000, 16, 3, b"x" * 32, contribute, code)
            assert wire.ExchangeHeader.decode(h.encode()) == h
    with pytest.raises(FatalFtarError):
        wire.ExchangeHeader(7, 3, 1, 4, 1000, 16, 3, b"x" * 32, True, 4).encode()
    assert wire.Ready.decode(wire.Ready(7, 3).encode()) == wire.Ready(7, 3)
    challenge = wire.Challenge(b"n" * 16)
    assert wire.Challenge.decode(challenge.encode()) == challenge
    assert wire.Ack.decode(wire.Ack(wire.AckStatus.STALE_EPOCH, 9).encode()).epoch == 9
    chunk = wire.ChunkHeader(3, 5, 2, 64)
    assert wire.ChunkHeader.decode(chunk.encode()) == chunk
    hello = wire.Hello(7, 1, 4, "127.0.0.1:5555").encode()
    assert wire.Hello.decode_prefix(hello[: wire.HELLO_PREFIX_SIZE], 16) == (7, 1, 4, 14)


def test_hostile_or_foreign_messages_are_refused() -> None:
    hello = wire.Hello(7, 1, 4, "h:1").encode()
    with pytest.raises(FtarPeerError):  # ring larger than this rank accepts
        wire.Hello.decode_prefix(hello[: wire.HELLO_PREFIX_SIZE], 2)
    with pytest.raises(FtarPeerError):  # position outside the ring
        wire.Hello.decode_prefix(wire.Hello(7, 4, 4, "h:1").encode()[: wire.HELLO_PREFIX_SIZE], 9)
    with pytest.raises(FtarPeerError):
        wire.Ready.decode(b"HTTP" + wire.Ready(1, 1).encode()[4:])
    with pytest.raises(FatalFtarError):  # another protocol version
        wire.Ready.decode(
            wire.Ready(1, 1).encode()[:4] + b"\x00\x09" + wire.Ready(1, 1).encode()[6:]
        )
    with pytest.raises(FtarPeerError):  # a READY where an ACK belongs
        wire.Ack.decode(wire.Ready(1, 1).encode()[: wire.ACK_SIZE])
    with pytest.raises(FtarPeerError):
        wire.ChunkHeader.decode(b"\x00" * wire.CHUNK_SIZE)
    with pytest.raises(FatalFtarError):
        wire.Hello(1, 0, 1, "x" * 300).encode()


def test_layout_digest_sees_dtype_and_shape() -> None:
    a = wire.layout_digest([torch.zeros(2, 3), torch.zeros(4)])
    assert a == wire.layout_digest([torch.ones(2, 3), torch.ones(4)])
    assert a != wire.layout_digest([torch.zeros(3, 2), torch.zeros(4)])
    assert a != wire.layout_digest([torch.zeros(2, 3, dtype=torch.bfloat16), torch.zeros(4)])


def test_sendmsg_all_and_recv_exact_move_every_byte() -> None:
    a, b = socket.socketpair()
    with a, b:
        parts = [memoryview(bytes(range(256)) * 40), memoryview(b""), memoryview(b"tail")]
        sent = wire.sendmsg_all(a, parts)
        out = bytearray(sent)
        wire.recv_exact(b, memoryview(out))
        assert bytes(out) == bytes(range(256)) * 40 + b"tail"
        a.close()
        with pytest.raises(FtarPeerError):
            wire.recv_exact(b, memoryview(bytearray(1)))


@settings(max_examples=60, deadline=None)
@given(numel=st.integers(0, 300), size=st.integers(1, 6), chunk=st.integers(1, 20))
def test_plan_pieces_tile_the_vector_and_neighbours_agree(
    numel: int, size: int, chunk: int
) -> None:
    plans = [RingPlan(numel, size, r, chunk) for r in range(size)]
    plan = plans[0]
    covered = []
    for c in range(plan.columns):
        for p in range(size):
            lo, hi = plan.piece(c, p)
            assert 0 <= lo <= hi <= numel
            assert hi - lo <= chunk
            covered.extend(range(lo, hi))
    assert covered == list(range(numel))
    for r in range(size):
        right = plans[(r + 1) % size]
        for s in range(plan.steps):  # what r sends at step s is what its right expects
            assert plans[r].send_piece(s) == right.recv_piece(s)
        # After reduce-scatter rank r owns piece r + 1; all-gather then fills every other piece.
        received = {plans[r].recv_piece(s) for s in range(size - 1, plan.steps)}
        assert received == set(range(size)) - {(r + 1) % size}


def test_flat_buffer_views_span_segments_without_copies() -> None:
    segs = [torch.arange(5.0), torch.arange(5.0, 8.0), torch.arange(8.0, 12.0)]
    flat = FlatBuffer(segs)
    assert flat.numel == 12
    parts = flat.tensors(3, 9)
    assert [p.tolist() for p in parts] == [[3.0, 4.0], [5.0, 6.0, 7.0], [8.0]]
    assert all(
        p.untyped_storage().data_ptr() == s.untyped_storage().data_ptr()
        for p, s in zip(parts, segs, strict=True)
    )
    views = flat.views(3, 9)
    assert sum(v.nbytes for v in views) == 6 * 4
    views[1][:4] = torch.tensor([42.0]).numpy().tobytes()
    assert segs[1][0].item() == 42.0


def test_flat_buffer_of_bf16_views_whole_two_byte_elements() -> None:
    segs = [torch.arange(3.0).bfloat16(), torch.arange(3.0, 8.0).bfloat16()]
    flat = FlatBuffer(segs)
    assert (flat.dtype, flat.itemsize, flat.numel) == (torch.bfloat16, 2, 8)
    views = flat.views(1, 6)  # an odd count of elements across the segment boundary
    assert [v.nbytes for v in views] == [4, 6]
    views[1][2:4] = torch.tensor([42.0], dtype=torch.bfloat16).view(torch.uint8).numpy().tobytes()
    assert segs[1][1].item() == 42.0
    with pytest.raises(ValueError, match="one dtype"):
        FlatBuffer([torch.zeros(2), torch.zeros(2, dtype=torch.bfloat16)])


def test_flat_buffer_takes_one_element_views_of_any_stride() -> None:
    # numpy-born empty arrays and broadcast 1-element tensors come with stride 0
    one = torch.ones(1, dtype=torch.bfloat16).as_strided((1,), (0,))
    empty = torch.ones(0, dtype=torch.bfloat16).as_strided((0,), (0,))
    flat = FlatBuffer([empty, one, torch.ones(1, dtype=torch.bfloat16)])
    assert [v.nbytes for v in flat.views(0, 2)] == [2, 2]
    flat.views(0, 1)[0][:] = torch.tensor([5.0], dtype=torch.bfloat16).view(torch.uint8).numpy()
    assert one.item() == 5.0
