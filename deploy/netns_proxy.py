"""`python -m fthsdp.deploy.netns_proxy`: a TCP proxy that adds latency, for a kernel without
`netem`.

    python -m fthsdp.deploy.netns_proxy --listen 10.213.0.1:7000 --target 10.213.0.2:7000 \\
        --delay-ms 50

Every byte read from either side is written to the other `--delay-ms` after it arrived, in order:
a round trip through the proxy takes at least twice the delay, and a bulk stream keeps its rate
(chunks in flight overlap; the delay is not paid per chunk in turn). It runs wherever it is
started, so `deploy.netns.Topology.delay_proxy` starts it inside a host's namespace with
`ip netns exec`. Once listening it prints one line, `listening on HOST:PORT` (port 0 picks a free
one), and it stops on SIGTERM or SIGINT: no new connections, open ones closed.

Closing is passed on: an end of stream from one side reaches the other side after the queued
bytes (its own delay included), and the connection closes once both directions have ended or
either side fails. A target that does not accept closes the client's connection at once.
`DelayProxy` is the same proxy embedded in a running event loop, as the tests' `TcpProxy`
(`tests/tcp_proxy.py`) is for loopback blackholes."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

log = logging.getLogger(__name__)

_CHUNK = 65536
_QUEUED_CHUNKS = 256
"""Chunks held per direction before reading pauses (backpressure): at most 16 MiB."""
_CONNECT_TIMEOUT_S = 5.0


@dataclass(frozen=True, kw_only=True, slots=True)
class ProxyConfig:
    """Where the proxy listens, where it forwards, and how late."""

    listen_host: str
    """Address to listen on (a host's address inside its namespace, or 127.0.0.1)."""
    listen_port: int = 0
    """Port to listen on; 0 picks a free one (`DelayProxy.port`)."""
    target_host: str
    """Address every connection is forwarded to."""
    target_port: int
    """Port every connection is forwarded to."""
    delay: timedelta
    """Added to every byte's trip, each direction."""

    def __post_init__(self) -> None:
        if not self.listen_host or not self.target_host:
            raise ValueError("listen and target hosts must not be empty")
        if not 0 <= self.listen_port <= 65535 or not 0 < self.target_port <= 65535:
            raise ValueError("ports must be in 1..65535 (the listen port may be 0)")
        if not timedelta(0) <= self.delay <= timedelta(minutes=1):
            raise ValueError(f"delay must be in [0, 60 s], got {self.delay}")


class DelayProxy:
    """The proxy on the running event loop: `await start()`, `port`, `await stop()`."""

    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        self._delay_s = config.delay.total_seconds()
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task[None]] = set()
        self.port = 0
        """The bound port, once started."""

    async def start(self) -> int:
        """Binds and starts accepting; returns the bound port."""
        self._server = await asyncio.start_server(
            self._accept, self.config.listen_host, self.config.listen_port
        )
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self.port

    async def stop(self) -> None:
        """Stops accepting and closes every connection (idempotent)."""
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
        for task in list(self._connections):
            task.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        try:
            await self._serve(reader, writer)
        finally:
            self._connections.discard(task)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        target = (self.config.target_host, self.config.target_port)
        try:
            up_reader, up_writer = await asyncio.wait_for(
                asyncio.open_connection(*target), _CONNECT_TIMEOUT_S
            )
        except (OSError, TimeoutError) as exc:
            log.info("target %s:%d did not accept: %s", *target, exc)
            writer.close()
            return
        pipes = [
            asyncio.create_task(self._pipe(reader, up_writer)),
            asyncio.create_task(self._pipe(up_reader, writer)),
        ]
        try:
            # Both directions end normally (each passes its end of stream on), or the first
            # failure ends the connection.
            done, _ = await asyncio.wait(pipes, return_when=asyncio.FIRST_EXCEPTION)
            for task in done:
                if (error := task.exception()) is not None and not isinstance(error, OSError):
                    raise error
        finally:
            for task in pipes:
                task.cancel()
            await asyncio.gather(*pipes, return_exceptions=True)
            for each in (writer, up_writer):
                each.close()
                with contextlib.suppress(OSError):
                    await each.wait_closed()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One direction: read, hold each chunk until it is due, write; then the end of stream."""
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue(_QUEUED_CHUNKS)

        async def read() -> None:
            while data := await reader.read(_CHUNK):
                await queue.put((time.monotonic() + self._delay_s, data))
            await queue.put((time.monotonic() + self._delay_s, b""))

        reading = asyncio.create_task(read())
        try:
            while True:
                due, data = await queue.get()
                if (wait := due - time.monotonic()) > 0:
                    await asyncio.sleep(wait)
                if not data:
                    if writer.can_write_eof():
                        writer.write_eof()
                    return
                writer.write(data)
                await writer.drain()
        finally:
            reading.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reading


def _address(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host, int(port)


def parse_args(argv: Sequence[str] | None = None) -> ProxyConfig:
    parser = argparse.ArgumentParser(
        prog="python -m fthsdp.deploy.netns_proxy",
        description="a TCP proxy that delays every byte, each direction (netem-free latency)",
    )
    parser.add_argument("--listen", type=_address, required=True, help="HOST:PORT (port 0: any)")
    parser.add_argument("--target", type=_address, required=True, help="HOST:PORT to forward to")
    parser.add_argument(
        "--delay-ms", type=int, required=True, help="added to each direction of every byte, ms"
    )
    args = parser.parse_args(argv)
    try:
        return ProxyConfig(
            listen_host=args.listen[0],
            listen_port=args.listen[1],
            target_host=args.target[0],
            target_port=args.target[1],
            delay=timedelta(milliseconds=args.delay_ms),
        )
    except ValueError as exc:
        parser.error(str(exc))


async def _serve(config: ProxyConfig) -> None:
    proxy = DelayProxy(config)
    port = await proxy.start()
    print(f"listening on {config.listen_host}:{port}", flush=True)
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stopping.set)
    await stopping.wait()
    await proxy.stop()


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s", stream=sys.stderr)
    asyncio.run(_serve(parse_args(argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
