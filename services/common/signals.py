"""How every fthsdp service process waits for its end: SIGTERM or SIGINT starts a graceful drain,
a second SIGINT exits at once (correct as PID 1 in a container, where the default handlers do
nothing)."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from collections.abc import Callable
from typing import Any, Protocol, TextIO

from fthsdp.services.common import gc_tuning

log = logging.getLogger(__name__)

_FORCED_EXIT_CODE = 130


def shutdown_signal() -> asyncio.Event:
    """An event set at the first SIGTERM or SIGINT (the caller then drains). Its handlers are
    installed at once, on the running loop: call it before starting to serve, so a signal that
    arrives while the service starts is a drain too, not the default action's abrupt death."""
    stop = asyncio.Event()
    interrupts = 0
    loop = asyncio.get_running_loop()

    def on_signal(signum: int) -> None:
        nonlocal interrupts
        if signum == signal.SIGINT:
            interrupts += 1
            if interrupts > 1:
                log.warning("second interrupt: exiting without draining")
                os._exit(_FORCED_EXIT_CODE)
        log.info("signal %s: draining", signal.Signals(signum).name)
        stop.set()

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal, signum)
    return stop


class _Served(Protocol):
    async def start(self) -> Any: ...

    async def stop(self) -> Any: ...


async def serve_until_signalled(
    server: _Served, banner: Callable[[], str], out: TextIO | None = None
) -> None:
    """A service process's life: start `server`, settle the collector (`gc_tuning`), print the
    one banner line, serve until SIGTERM/SIGINT, then `stop` it (its drain)."""
    stop = shutdown_signal()
    await server.start()
    gc_tuning.settle()
    print(banner(), file=out or sys.stdout, flush=True)
    try:
        await stop.wait()
    finally:
        await server.stop()
