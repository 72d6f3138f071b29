"""Watch streams of the quorum clients (membership events; `QuorumClient.watch` and
`AsyncQuorumClient.watch` open them), and the one translation of a failed call to its error."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any, cast

import grpc

from fthsdp.services.common.errors import code_in
from fthsdp.services.quorum import client_codec as codec
from fthsdp.services.quorum.domain import (
    ERROR_WIRE,
    MembershipEvent,
    QuorumError,
    QuorumUnavailableError,
)


def translate(err: grpc.RpcError) -> QuorumError:
    """The typed error a failed call stands for (`domain.ERROR_WIRE`)."""
    call = cast(grpc.Call, err)
    code = code_in(cast(Any, call.trailing_metadata()))
    return cast(QuorumError, ERROR_WIRE.from_grpc(call.code(), call.details() or "", code))


class WatchStream(Iterator[MembershipEvent]):
    """A blocking iterator of membership events; `cancel()` (from any thread) ends it."""

    def __init__(self, call: Any, forget: Any, failed: Callable[[], None]) -> None:
        self._call = call
        self._forget = forget
        self._failed = failed
        self._cancelled = False

    def __iter__(self) -> WatchStream:
        return self

    def __next__(self) -> MembershipEvent:
        try:
            msg = next(self._call)
        except StopIteration:
            self._forget(self)
            raise
        except grpc.RpcError as err:
            self._forget(self)
            if self._cancelled:
                raise StopIteration from None
            error = translate(err)
            if isinstance(error, QuorumUnavailableError):
                self._failed()  # the next watch() asks another instance
            raise error from None
        return codec.event_from_pb(msg)

    def cancel(self) -> None:
        """Ends the stream; a blocked `next()` returns StopIteration."""
        self._cancelled = True
        self._call.cancel()

    def __enter__(self) -> WatchStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cancel()


class AsyncWatchStream:
    """An async iterator of membership events; `cancel()` ends it."""

    def __init__(
        self,
        call: Any,
        failed: Callable[[], None],
        forget: Callable[[AsyncWatchStream], None] = lambda _: None,
    ) -> None:
        self._call = call
        self._failed = failed
        self._forget = forget
        self._cancelled = False

    def __aiter__(self) -> AsyncIterator[MembershipEvent]:
        return self._events()

    async def _events(self) -> AsyncIterator[MembershipEvent]:
        try:
            async for msg in self._call:
                yield codec.event_from_pb(msg)
        except asyncio.CancelledError:
            if not self._cancelled:
                raise
        except grpc.RpcError as err:
            if self._cancelled:
                return
            error = translate(err)
            if isinstance(error, QuorumUnavailableError):
                self._failed()
            raise error from None
        finally:
            self._forget(self)

    def cancel(self) -> None:
        """Ends the stream."""
        self._cancelled = True
        self._call.cancel()
        self._forget(self)
