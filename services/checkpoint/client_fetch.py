"""Fetching a rank's state from one or more sidecars: striped, checksummed, retried, deadlined.

Every source serves the same bytes (healthy replicas are bitwise identical), so the fetcher takes
every manifest, insists they agree (a disagreement is silent data corruption and names the sources),
then spreads stripes of whole checksum chunks over the live sources with `parallel` threads. Each
response body is read with `readinto` straight into the destination tensors, each chunk is verified
against the manifest, and a chunk that fails (dead source, truncated body, bad checksum) goes back
to the queue for another source. One overall deadline bounds everything (TimeoutError)."""

from __future__ import annotations

import bisect
import http.client
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from datetime import timedelta

import torch

from fthsdp.services.checkpoint.client_errors import (
    CheckpointError,
    CorruptionError,
    GoneError,
    InvalidArgumentError,
    NotFoundError,
    SourcesDisagreeError,
    SourceUnavailableError,
)
from fthsdp.services.checkpoint.client_http import (
    BaseUrl,
    Connection,
    call_json,
    error_from_response,
)
from fthsdp.services.checkpoint.client_manifest import Manifest, check_id, check_rank, check_step
from fthsdp.services.common.crc import crc32
from fthsdp.services.common.tokens import Token

TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
DTYPE_NAMES = {v: k for k, v in TORCH_DTYPES.items()}
DEFAULT_MAX_BYTES = 1 << 40
"""Refuse manifests that claim more than this many bytes (1 TiB) before allocating anything."""
DEFAULT_STRIPE_BYTES = 256 << 20
"""Bytes per range request at most: the sidecar's default `max_range_bytes`. Fewer, longer requests
keep each connection streaming: every request costs a round trip through the serving process,
whose event loop yields to training (niced), and measured 5 % of a 1 GB fetch at 64 MiB."""
MAX_SOURCE_FAILURES = 2
"""Consecutive failed requests after which a source is considered dead for this fetch."""


@dataclass(frozen=True, slots=True)
class Source:
    """A sidecar serving `replica_id`'s snapshot of the rank and step being fetched."""

    url: str
    replica_id: str


@dataclass(slots=True)
class SourceStats:
    """What one source contributed to a fetch."""

    url: str
    label: str
    bytes: int = 0
    requests: int = 0
    failures: int = 0
    dead: bool = False
    last_error: str | None = None
    _consecutive: int = field(default=0, repr=False)


@dataclass(frozen=True, slots=True)
class FetchedSnapshot:
    """A fetched, fully verified state: tensors by name (CPU, or the caller's `into` tensors)."""

    step: int
    tensors: dict[str, torch.Tensor]
    meta: dict[str, str | int]
    bytes_fetched: int
    seconds: float
    sources: tuple[SourceStats, ...]
    checksum_seconds: float = 0.0
    """Time the fetch threads spent checksumming, all together (the one pass over the bytes a
    plain copy does not make)."""


@dataclass(frozen=True, slots=True)
class _Origin:
    """Where one source's manifest and data live: `{url}{path}/manifest` and `{url}{path}/data`."""

    url: str
    label: str
    path: str


@dataclass(slots=True)
class _Stripe:
    first: int
    end: int
    avoid: frozenset[int] = frozenset()
    corrupt: bool = False


class _StripeFailed(Exception):
    def __init__(
        self, verified: int, corrupt: bool, reason: str, *, too_long: bool = False
    ) -> None:
        super().__init__(reason)
        self.verified = verified
        self.corrupt = corrupt
        self.too_long = too_long


def fetch_snapshot(
    sources: Sequence[Source],
    *,
    job: str,
    rank: int,
    step: int,
    token: Token | str,
    deadline: timedelta,
    into: Mapping[str, torch.Tensor] | None = None,
    stripe_bytes: int = DEFAULT_STRIPE_BYTES,
    parallel: int = 4,
    request_timeout: timedelta = timedelta(seconds=10),
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> FetchedSnapshot:
    """Fetches `rank`'s snapshot of `step` from the sidecars of `sources`, striped across them.

    Raises TimeoutError past `deadline`, SourcesDisagreeError when manifests differ,
    CorruptionError when a chunk fails its checksum on every source, NotFoundError when no source
    has the step, SourceUnavailableError when every source failed."""
    check_id("job", job)
    check_rank(rank)
    check_step(step)
    if not sources:
        raise InvalidArgumentError("fetch_snapshot needs at least one source")
    origins = [
        _Origin(
            s.url,
            check_id("replica", s.replica_id),
            f"/v1/snapshots/{job}/{s.replica_id}/{rank}/{step}",
        )
        for s in sources
    ]
    return _fetch(
        origins,
        _token(token),
        into=into,
        deadline=deadline,
        stripe_bytes=stripe_bytes,
        parallel=parallel,
        request_timeout=request_timeout,
        max_bytes=max_bytes,
    )


def restore_latest(
    url: str,
    token: Token | str,
    job: str,
    rank: int,
    world_size: int,
    *,
    into: Mapping[str, torch.Tensor] | None = None,
    deadline: timedelta = timedelta(minutes=10),
    parallel: int = 4,
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> FetchedSnapshot | None:
    """Restores `rank` from the newest complete, verified durable checkpoint of `job`.

    Returns None when the job has no complete checkpoint for `world_size` ranks."""
    check_id("job", job)
    check_rank(rank, world_size)
    tok = _token(token)
    start = time.monotonic()
    try:
        latest = call_json(
            url,
            tok,
            "GET",
            f"/v1/checkpoints/{job}/latest?world_size={world_size}",
            timeout=deadline,
        )
    except NotFoundError:
        return None
    step = check_step(latest["step"])
    left = deadline - timedelta(seconds=time.monotonic() - start)
    return fetch_checkpoint(
        url, tok, job=job, step=step, rank=rank, deadline=left, into=into, parallel=parallel,
        max_bytes=max_bytes,
    )  # fmt: skip


def fetch_checkpoint(
    url: str,
    token: Token | str,
    *,
    job: str,
    step: int,
    rank: int,
    deadline: timedelta,
    into: Mapping[str, torch.Tensor] | None = None,
    parallel: int = 4,
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> FetchedSnapshot:
    """Fetches `rank`'s part of durable checkpoint `step` of `job` (every chunk verified).

    Raises NotFoundError when the sidecar has no such checkpoint, CorruptionError when its bytes
    fail their checksums, TimeoutError past `deadline`."""
    check_id("job", job)
    check_rank(rank)
    check_step(step)
    origin = _Origin(url, url, f"/v1/checkpoints/{job}/{step}/{rank}")
    return _fetch(
        [origin],
        _token(token),
        into=into,
        deadline=deadline,
        stripe_bytes=DEFAULT_STRIPE_BYTES,
        parallel=parallel,
        request_timeout=timedelta(seconds=30),
        max_bytes=max_bytes,
    )


def _token(token: Token | str) -> Token:
    return token if isinstance(token, Token) else Token(token)


def _fetch(
    origins: list[_Origin],
    token: Token,
    *,
    into: Mapping[str, torch.Tensor] | None,
    deadline: timedelta,
    stripe_bytes: int,
    parallel: int,
    request_timeout: timedelta,
    max_bytes: int,
) -> FetchedSnapshot:
    if parallel < 1 or stripe_bytes < 1:
        raise InvalidArgumentError("parallel and stripe_bytes must be positive")
    start = time.monotonic()
    end = start + deadline.total_seconds()
    stats = [SourceStats(o.url, o.label) for o in origins]
    manifest, live = _agreed_manifest(origins, token, stats, end, max_bytes)
    dest = _Destination(manifest, into)
    fetcher = _StripedFetch(origins, token, manifest, dest, stats, live, end, request_timeout)
    fetcher.run(stripe_bytes, parallel)
    dest.finish()
    return FetchedSnapshot(
        step=manifest.step,
        tensors=dest.tensors,
        meta=dict(manifest.meta),
        bytes_fetched=sum(s.bytes for s in stats),
        seconds=time.monotonic() - start,
        sources=tuple(stats),
        checksum_seconds=fetcher.checksum_seconds,
    )


def _agreed_manifest(
    origins: list[_Origin], token: Token, stats: list[SourceStats], end: float, max_bytes: int
) -> tuple[Manifest, list[bool]]:
    """Every source's manifest, fetched in parallel; the sources that answered must agree."""

    def get(origin: _Origin) -> Manifest:
        left = timedelta(seconds=max(end - time.monotonic(), 0.0))
        raw = call_json(origin.url, token, "GET", origin.path + "/manifest", timeout=left)
        return Manifest.from_json(raw, max_total_bytes=max_bytes)

    results: list[Manifest | BaseException] = []
    with ThreadPoolExecutor(max_workers=len(origins)) as pool:
        for fut in [pool.submit(get, o) for o in origins]:
            try:
                results.append(fut.result())
            except (CheckpointError, OSError, http.client.HTTPException, ValueError) as exc:
                results.append(exc)
    live = [isinstance(r, Manifest) for r in results]
    for stat, result in zip(stats, results, strict=True):
        if not isinstance(result, Manifest):
            stat.dead, stat.last_error, stat.failures = True, f"manifest: {result}", 1
    good = [(o, r) for o, r in zip(origins, results, strict=True) if isinstance(r, Manifest)]
    if not good:
        errors = [r for r in results if isinstance(r, BaseException)]
        summary = "; ".join(f"{o.label}: {e}" for o, e in zip(origins, errors, strict=True))
        if all(isinstance(e, GoneError) for e in errors):
            raise GoneError(f"every source garbage-collected the snapshot: {summary}")
        if all(isinstance(e, NotFoundError) for e in errors):
            raise NotFoundError(f"no source has the snapshot: {summary}")
        if all(isinstance(e, TimeoutError) for e in errors):
            raise TimeoutError(f"no manifest before the deadline: {summary}")
        raise SourceUnavailableError(f"no source answered with a manifest: {summary}")
    first_origin, first = good[0]
    for origin, other in good[1:]:
        why = first.disagreement(other)
        if why:
            raise SourcesDisagreeError(
                f"sources {first_origin.label} ({first_origin.url}) and {origin.label} "
                f"({origin.url}) disagree on step {first.step}: {why}"
            )
    return first, live


class _Destination:
    """Preallocated destination memory and the map from snapshot bytes to it."""

    def __init__(self, manifest: Manifest, into: Mapping[str, torch.Tensor] | None) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self._copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._starts: list[int] = []
        self._views: list[memoryview] = []
        wanted = {t.name for t in manifest.layout.tensors}
        extra = sorted(set(into or {}) - wanted)
        if extra:
            raise InvalidArgumentError(f"`into` has tensors the snapshot lacks: {extra[:5]}")
        if into is None:
            self._allocate_flat(manifest)
        else:
            self._map_into(manifest, into)

    def _allocate_flat(self, manifest: Manifest) -> None:
        flat = torch.empty(manifest.layout.total_bytes, dtype=torch.uint8)
        for entry in manifest.layout.tensors:
            dtype = TORCH_DTYPES[entry.dtype]
            if entry.nbytes == 0:
                self.tensors[entry.name] = torch.empty(entry.shape, dtype=dtype)
                continue
            piece = flat[entry.offset : entry.offset + entry.nbytes]
            self.tensors[entry.name] = piece.view(dtype).reshape(entry.shape)
        if manifest.layout.total_bytes:
            self._starts, self._views = [0], [_writable_bytes(flat)]

    def _map_into(self, manifest: Manifest, into: Mapping[str, torch.Tensor]) -> None:
        for entry in manifest.layout.tensors:
            dtype = TORCH_DTYPES[entry.dtype]
            target = into.get(entry.name)
            if target is None:
                target = torch.empty(entry.shape, dtype=dtype)
            elif target.dtype != dtype or tuple(target.shape) != entry.shape:
                raise InvalidArgumentError(
                    f"`into[{entry.name!r}]` is {DTYPE_NAMES.get(target.dtype, target.dtype)}"
                    f"{tuple(target.shape)}, the snapshot has {entry.dtype}{entry.shape}"
                )
            self.tensors[entry.name] = target
            if entry.nbytes == 0:
                continue
            landing = target
            if target.device.type != "cpu" or not target.is_contiguous():
                landing = torch.empty(entry.shape, dtype=dtype)
                self._copies.append((target, landing))
            self._starts.append(entry.offset)
            self._views.append(_writable_bytes(landing))
        order = sorted(range(len(self._starts)), key=self._starts.__getitem__)
        self._starts = [self._starts[i] for i in order]
        self._views = [self._views[i] for i in order]

    def pieces(self, start: int, stop: int, scratch: memoryview) -> list[memoryview]:
        """Writable views covering snapshot bytes [start, stop); gaps land in `scratch`."""
        starts, views = self._starts, self._views
        out: list[memoryview] = []
        pos = start
        i = max(bisect.bisect_right(starts, pos) - 1, 0)
        while pos < stop:
            if i < len(starts) and starts[i] <= pos < starts[i] + len(views[i]):
                take = min(stop, starts[i] + len(views[i])) - pos
                out.append(views[i][pos - starts[i] : pos - starts[i] + take])
                pos += take
                i += 1
            elif i < len(starts) and starts[i] <= pos:
                i += 1
            else:
                gap_end = min(stop, starts[i]) if i < len(starts) else stop
                out.append(scratch[: gap_end - pos])
                pos = gap_end
        return out

    def finish(self) -> None:
        with torch.no_grad():
            for target, landing in self._copies:
                target.copy_(landing)


class _StripedFetch:
    """The worker pool: stripes of chunks, assigned to the least busy live source."""

    def __init__(
        self,
        origins: list[_Origin],
        token: Token,
        manifest: Manifest,
        dest: _Destination,
        stats: list[SourceStats],
        live: list[bool],
        end: float,
        request_timeout: timedelta,
    ) -> None:
        self.origins, self.token, self.manifest, self.dest = origins, token, manifest, dest
        self.stats, self.live, self.end = stats, live, end
        self.request_timeout = request_timeout.total_seconds()
        self.cond = threading.Condition()
        self.pending: deque[_Stripe] = deque()
        self.busy = [0] * len(origins)
        self.in_flight = 0
        self.error: BaseException | None = None
        self.checksum_seconds = 0.0

    def run(self, stripe_bytes: int, parallel: int) -> None:
        chunk = self.manifest.chunk_bytes
        n_chunks = len(self.manifest.checksums)
        if n_chunks == 0:
            return
        per = max(1, min(stripe_bytes // chunk, -(-n_chunks // parallel)))
        self.pending.extend(_Stripe(i, min(i + per, n_chunks)) for i in range(0, n_chunks, per))
        workers = [
            threading.Thread(target=self._worker, name=f"fthsdp-fetch-{i}", daemon=True)
            for i in range(min(parallel, len(self.pending)))
        ]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        if self.error is not None:
            raise self.error

    def _worker(self) -> None:
        conns: dict[int, Connection] = {}
        scratch = memoryview(bytearray(self.manifest.chunk_bytes))
        checksummed = [0.0]
        try:
            while True:
                job = self._next()
                if job is None:
                    return
                stripe, src = job
                conn = conns.get(src)
                if conn is None:
                    conn = conns[src] = Connection(BaseUrl.parse(self.origins[src].url), self.token)
                try:
                    self._fetch_stripe(conn, src, stripe, scratch, checksummed)
                    self._done(stripe, src, None)
                except _StripeFailed as failure:
                    conn.close()
                    self._done(stripe, src, failure)
        except BaseException as exc:  # a bug or an allocation failure: fail the whole fetch
            with self.cond:
                self.error = self.error or exc
                self.cond.notify_all()
        finally:
            for c in conns.values():
                c.close()
            with self.cond:
                self.checksum_seconds += checksummed[0]

    def _next(self) -> tuple[_Stripe, int] | None:
        with self.cond:
            while self.error is None and not self.pending and self.in_flight:
                left = self.end - time.monotonic()
                if left <= 0:
                    break
                self.cond.wait(left)
            if self.error is not None or (not self.pending and not self.in_flight):
                return None
            if time.monotonic() >= self.end:
                self.error = TimeoutError(f"fetch of step {self.manifest.step} passed its deadline")
                self.cond.notify_all()
                return None
            stripe = self.pending.popleft()
            candidates = [
                i for i in range(len(self.origins)) if self.live[i] and i not in stripe.avoid
            ]
            if not candidates:
                self.error = self._no_source_error(stripe)
                self.cond.notify_all()
                return None
            src = min(candidates, key=lambda i: (self.busy[i], (i - stripe.first) % len(self.busy)))
            self.busy[src] += 1
            self.in_flight += 1
            return stripe, src

    def _no_source_error(self, stripe: _Stripe) -> CheckpointError:
        tried = ", ".join(
            f"{self.origins[i].label} ({self.stats[i].last_error})" for i in sorted(stripe.avoid)
        )
        what = f"chunk {stripe.first} of step {self.manifest.step}"
        if stripe.corrupt:
            return CorruptionError(f"{what} failed its checksum on every source: {tried}")
        dead = ", ".join(
            f"{o.label} ({s.last_error})"
            for o, s in zip(self.origins, self.stats, strict=True)
            if s.dead
        )
        return SourceUnavailableError(f"no live source left for {what}: {tried or dead}")

    def _done(self, stripe: _Stripe, src: int, failure: _StripeFailed | None) -> None:
        with self.cond:
            self.busy[src] -= 1
            self.in_flight -= 1
            stat = self.stats[src]
            if failure is None:
                stat._consecutive = 0
            elif failure.too_long:  # a source with a lower `max_range_bytes`: ask for halves
                half = (stripe.first + stripe.end) // 2
                self.pending.appendleft(replace(stripe, first=half))
                self.pending.appendleft(replace(stripe, end=half))
            else:
                stat.failures += 1
                stat._consecutive += 1
                stat.last_error = str(failure)
                if stat._consecutive >= MAX_SOURCE_FAILURES:
                    stat.dead, self.live[src] = True, False
                rest = _Stripe(
                    stripe.first + failure.verified,
                    stripe.end,
                    stripe.avoid | {src},
                    stripe.corrupt or failure.corrupt,
                )
                self.pending.appendleft(rest)
            self.cond.notify_all()

    def _fetch_stripe(
        self,
        conn: Connection,
        src: int,
        stripe: _Stripe,
        scratch: memoryview,
        checksummed: list[float],
    ) -> None:
        """Reads one stripe into the destination, verifying each chunk; adds the time spent
        checksumming to `checksummed[0]`."""
        chunk, total = self.manifest.chunk_bytes, self.manifest.layout.total_bytes
        start, stop = stripe.first * chunk, min(stripe.end * chunk, total)
        verified = 0
        stat = self.stats[src]
        timeout = min(self.request_timeout, self.end - time.monotonic())
        try:
            if timeout <= 0:
                raise TimeoutError("deadline passed")
            stat.requests += 1
            resp = conn.request(
                "GET",
                self.origins[src].path + "/data",
                timeout=timeout,
                headers={"range": f"bytes={start}-{stop - 1}", "accept": "*/*"},
            )
            if resp.status != 206:
                reason = f"HTTP {resp.status}: {error_from_response(resp)}"
                # 416 for a range inside the object: longer than this source serves at once
                too_long = resp.status == 416 and stripe.end - stripe.first > 1
                raise _StripeFailed(0, False, reason, too_long=too_long)
            expected = f"bytes {start}-{stop - 1}/{total}"
            if resp.getheader("content-range") != expected:
                raise _StripeFailed(0, False, f"wrong content-range, wanted {expected}")
            for index in range(stripe.first, stripe.end):
                a, b = index * chunk, min((index + 1) * chunk, total)
                crc = 0
                for piece in self.dest.pieces(a, b, scratch):
                    # Read whole pieces (up to a chunk), then checksum: slicing finer to keep
                    # the bytes in cache measured slower here: a reader that pauses often
                    # keeps TCP's receive window small. Checksums overlap the other
                    # connections' reads (`crc` is several GB/s).
                    _read_exactly(resp, piece)
                    began = time.perf_counter()
                    crc = crc32(piece, crc)
                    checksummed[0] += time.perf_counter() - began
                stat.bytes += b - a
                if crc != self.manifest.checksums[index]:
                    raise _StripeFailed(
                        verified, True, f"chunk {index} failed its checksum (crc32 {crc:#010x})"
                    )
                verified += 1
        except _StripeFailed:
            raise
        except (OSError, http.client.HTTPException, CheckpointError) as exc:
            raise _StripeFailed(verified, False, f"{type(exc).__name__}: {exc}") from exc


def _writable_bytes(tensor: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory (no copy)."""
    array = tensor.detach().reshape(-1).view(torch.uint8).numpy()
    return memoryview(array).cast("B")  # type: ignore[arg-type]  # ndarray is a Buffer at runtime


def _read_exactly(resp: http.client.HTTPResponse, into: memoryview) -> None:
    got = 0
    while got < len(into):
        n = resp.readinto(into[got:])
        if not n:
            raise http.client.IncompleteRead(b"", len(into) - got)
        got += n
