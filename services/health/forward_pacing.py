"""When a node agent forwards to the central service next: at its interval or the longer one
central asked for after a forward went through, and after a failed one a jittered backoff whose
ceiling depends on why it failed.

A forward that did not reach central (a cut link, central restarting) is retried within a few
seconds (`UNREACHABLE_MAX_BACKOFF_S`), so the agent is back soon after the link or central is.
A forward that reached a central too busy to answer it in time is retried ever later, up to the
longest interval central may ask for (`MAX_FORWARD_INTERVAL`): such a call cost central a call's
work all the same (~1 ms of grpc.aio whether or not its handler ran), and when every agent of a
large job starts, or comes back after a central restart, at once, retries a few seconds apart
are more calls than central answers. It would spend its whole core on calls that time out and
never register enough agents to ask them to space out (bench.scale at 11,264 agents: 3.2 K
calls a second, under 100 answered)."""

from __future__ import annotations

import random

import grpc

from fthsdp.services.common.backoff import Retries
from fthsdp.services.health.config import MAX_FORWARD_INTERVAL

UNREACHABLE_MAX_BACKOFF_S = 5.0
"""The longest pause after forwards that did not reach the central service."""

CHANNEL_OPTIONS: list[tuple[str, int]] = [
    # Pings every 2 s, between forwards too, so a blackholed link (nothing refused, the
    # connection still up as far as TCP knows) stops reading as a busy central within ~3 s.
    ("grpc.keepalive_time_ms", 2_000),
    ("grpc.keepalive_timeout_ms", 1_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2_000),
    ("grpc.enable_retries", 0),
]
"""An agent's channel to the central service (whose server allows pings every second)."""

_BUSY = frozenset(
    {
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.CANCELLED,  # grpc-core cancels calls queued past their deadline
        grpc.StatusCode.RESOURCE_EXHAUSTED,
    }
)


def central_busy(status: grpc.StatusCode | None, channel_ready: bool) -> bool:
    """Whether a failed forward reached a central service too busy for it: timed out, cancelled
    or refused for want of resources while the connection is up. Anything else (no connection,
    a refusal, central stopping) is taken for unreachable."""
    return channel_ready and status in _BUSY


class ForwardPacing:
    """The delays of one agent's forward loop."""

    def __init__(self, interval_s: float, rng: random.Random | None = None) -> None:
        self.interval_s = interval_s
        self.asked_s = 0.0
        """The interval central's last answer asked for (0: none asked)."""
        self._retries = Retries.after(interval_s, MAX_FORWARD_INTERVAL.total_seconds(), rng)

    def answered(self, asked_ms: int) -> float:
        """After a forward went through, whose answer asked for `asked_ms` (a uint32 off the
        wire, clamped to `MAX_FORWARD_INTERVAL`): the delay before the next."""
        self._retries.succeeded()
        self.asked_s = min(asked_ms / 1000, MAX_FORWARD_INTERVAL.total_seconds())
        return max(self.interval_s, self.asked_s)

    def failed(self, busy: bool) -> float:
        """After a failed forward (`central_busy`): the delay before the next try."""
        return self._retries.failed(None if busy else UNREACHABLE_MAX_BACKOFF_S)


def reached_busy_central(err: grpc.RpcError, channel: grpc.aio.Channel) -> bool:
    """`central_busy` for a call on `channel` that failed with `err`."""
    status = err.code() if isinstance(err, grpc.aio.AioRpcError) else None
    return central_busy(status, channel.get_state() == grpc.ChannelConnectivity.READY)
