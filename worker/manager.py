"""The per-rank Manager: the FT-HSDP step protocol (DESIGN.md, steps 1–5).

Per step: the leader asks the quorum service for a quorum (overlapped with the forward pass) and
broadcasts it inside the replica; every rank rebuilds its FTAR ring on a new quorum id; the
replica's gradient is averaged across the healthy replicas; every rank votes, and only a unanimous
replica applies the optimizer step. A failed vote retries the exchange on the next quorum from the
intact local gradient. A replica behind the healthy ones contributes zeros while it fetches their
state (published as a snapshot before their optimizer step), then applies the same averaged
gradient and is identical to them (I1)."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from fthsdp.services.quorum.client import (
    QuorumClient,
    RankEndpoint,
    WatchStream,
)
from fthsdp.worker.config import ManagerConfig
from fthsdp.worker.data import DataPositions
from fthsdp.worker.exchange import GradientExchange
from fthsdp.worker.faults import FaultPlan
from fthsdp.worker.ftar import FtarConfig, FtarRing, RecoverableFtarError
from fthsdp.worker.ftar.auth import ring_key
from fthsdp.worker.peer_state import PeerState, StateFetchError
from fthsdp.worker.plan import (
    StepPlan,
    decode_plan,
    fallback_payload,
    steady_max_step,
)
from fthsdp.worker.quorum_link import QuorumLink
from fthsdp.worker.replica_group import ReplicaGroup
from fthsdp.worker.state import fingerprint, load_state_tensors, state_tensors
from fthsdp.worker.telemetry import StepTelemetry

log = logging.getLogger(__name__)

POSITIONS_META = "positions"
STEP_META = "step"
_STEADY = -1
"""Plan header kind: the previous plan with a new max_step (no payload follows)."""
_RECORD_WAIT_S = 5.0
"""On shutdown, how long the last position record waits for the one before it."""


class TooManyFailedCommits(RuntimeError):
    """The replica failed to commit `max_failed_commits` times in a row; it stops."""


@dataclass(frozen=True, kw_only=True, slots=True)
class StepOutcome:
    """What happened in one call of `Manager.finish_step` (always a committed step)."""

    step: int
    """The step that was committed (the replica now stands at step + 1)."""
    quorum_id: int
    """The quorum whose exchange committed."""
    healthy: tuple[str, ...]
    """The replicas whose gradients this step averaged."""
    recovered: bool
    """This replica caught up from peers in this step (it contributed zeros)."""
    trained: dict[str, tuple[int, int]]
    """Per contributing replica, the range of its shard's positions this step trained."""
    attempts: int
    """Exchanges tried (1 unless a peer failed mid-exchange)."""
    seconds: dict[str, float] = field(default_factory=dict)
    """Wall time of the phases: quorum, exchange, fetch, commit."""
    without_control_plane: bool = False
    """Committed on the previous quorum while the quorum service was unreachable."""


@dataclass(kw_only=True, slots=True)
class _Overlap:
    """What the gradient hooks of the current step's backward did (`overlap_backward`)."""

    remaining: list[int]
    """Per bucket, the params whose gradient has not arrived yet."""
    captured: list[bool] = field(default_factory=list)
    plan: StepPlan | None = None
    quorum_s: float = 0.0
    ring_error: RecoverableFtarError | None = None
    launching: bool = False
    """The attempt has begun on the ring: captured buckets go out in bucket order."""
    error: Exception | None = None
    """Raised by `finish_step`; the hooks do nothing more this step."""

    def __post_init__(self) -> None:
        if not self.captured:
            self.captured = [False] * len(self.remaining)


class Manager:
    """One rank's part in fault-tolerant training. Create one per rank, after the model and the
    optimizer; call `start_step()` before the forward pass and `finish_step()` after backward
    (it runs the optimizer step itself)."""

    def __init__(
        self,
        *,
        config: ManagerConfig,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        group: ReplicaGroup,
        samples_per_step: int,
        ftar_config: FtarConfig | None = None,
        on_commit: Callable[[StepOutcome], None] | None = None,
        faults: FaultPlan | None = None,
    ) -> None:
        self.config = config
        self.model = model
        self.optimizer = optimizer
        self.group = group
        self.samples_per_step = samples_per_step
        self.step = 0
        self.positions = DataPositions()
        self._on_commit = on_commit
        self._faults = faults or FaultPlan([], None)
        self._base_lrs = [float(g["lr"]) for g in optimizer.param_groups]
        self._exchange = GradientExchange(
            list(model.parameters()), group, bucket_bytes=config.bucket_bytes
        )
        if config.overlap_backward and self._exchange.sharded:
            raise ValueError("overlap_backward is not supported with sharded (DTensor) params")
        self._overlap: _Overlap | None = None
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        if config.overlap_backward:
            for index, params in enumerate(self._exchange.bucket_params):
                for param in params:
                    self._hooks.append(
                        param.register_post_accumulate_grad_hook(  # type: ignore[no-untyped-call]
                            lambda _param, index=index: self._on_grad(index)
                        )
                    )
        ftar_config = ftar_config or FtarConfig()
        if not ftar_config.auth_key:  # only ranks of this job may join its rings
            ftar_config = dataclasses.replace(ftar_config, auth_key=ring_key(config.token))
        self._ring = FtarRing(ftar_config)
        self._peer_state = PeerState(config=config, rank=group.rank, world_size=group.world_size)
        self._executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="fthsdp-manager")
        self._pending: Future[bytes] | None = None
        self._plan: StepPlan | None = None
        self._sent_plan: bytes | None = None
        """Leader: the last plan payload broadcast in full."""
        self._stop = threading.Event()
        self._watch_stream: WatchStream | None = None
        self._endpoints = self._gather_endpoints()
        self._step_started: float | None = None
        self._positions_recorded = -math.inf
        """Leader: monotonic time the data positions were last sent to the sidecar."""
        self._position_record: Future[None] | None = None
        """Leader: the last send of the positions (one at a time, so they arrive in order)."""
        self._telemetry = StepTelemetry(
            config.health_address,
            config.token,
            replica_id=config.replica_id,
            rank=group.rank,
            fingerprint_every_steps=config.fingerprint_every_steps,
        )
        self._link = QuorumLink(config, self._endpoints, self._stop) if group.is_leader else None
        self._restore_durable()
        self._threads = [threading.Thread(target=self._watch, name="fthsdp-watch", daemon=True)]
        if self._link is not None:
            self._threads.append(
                threading.Thread(
                    target=self._link.heartbeat_loop, name="fthsdp-heartbeat", daemon=True
                )
            )
        for thread in self._threads:
            thread.start()

    # ---- setup ---------------------------------------------------------------------------

    def _gather_endpoints(self) -> list[RankEndpoint]:
        mine = f"{self._ring.address}|{self.config.checkpoint_url}".encode()
        endpoints = []
        for raw in self.group.all_gather_bytes(mine):
            ftar, _, checkpoint = raw.decode().partition("|")
            endpoints.append(RankEndpoint(ftar=ftar, checkpoint=checkpoint))
        return endpoints

    def _restore_durable(self) -> None:
        """A full restart: resume from the newest durable checkpoint, if the job has one."""
        step = self._peer_state.latest_durable_step() if self.group.is_leader else None
        agreed = self.group.broadcast_bytes(
            str(-1 if step is None else step).encode() if self.group.is_leader else None
        )
        chosen = int(agreed)
        if chosen < 0:
            return
        tensors, meta = self._peer_state.fetch_durable(chosen)
        self._load(tensors, meta, expected_step=chosen)
        log.info("restored durable checkpoint", extra=self._context(step=chosen))

    # ---- the step ------------------------------------------------------------------------

    def start_step(self) -> None:
        """Starts the quorum request (leader only) so it overlaps the forward pass."""
        if self._step_started is None:
            self._step_started = time.time()
        if self.group.is_leader and self._pending is None:
            self._pending = self._executor.submit(self._request_quorum, False)

    def finish_step(self, *, tokens: int = 0, sum_seq_len_sq: int = 0) -> StepOutcome:
        """Exchanges the gradient, votes, and applies the optimizer step once the replica agrees.

        `tokens` and `sum_seq_len_sq` (Σ l² over this rank's sequences of the step) describe the
        step's work for the health service's fail-slow predictor. Retries the exchange on new
        quorums until it commits; raises `TooManyFailedCommits` after `max_failed_commits`
        failures in a row, and `NoQuorumError` without a quorum."""
        began = time.monotonic()
        seconds = {"quorum": 0.0, "exchange": 0.0, "fetch": 0.0, "commit": 0.0}
        overlap, self._overlap = self._overlap, None
        if overlap is None:
            self.start_step()
            self._exchange.capture()
        else:
            if overlap.error is not None:
                self._exchange.abandon()
                raise overlap.error
            for index, captured in enumerate(overlap.captured):
                if not captured:  # params without a gradient this step
                    self._exchange.capture_bucket(index)
            seconds["quorum"] += overlap.quorum_s
        for attempt in range(1, self.config.max_failed_commits + 1):
            if attempt == 1 and overlap is not None:
                assert overlap.plan is not None  # else the hooks kept an error, raised above
                outcome = self._attempt(overlap.plan, attempt, seconds, overlap=overlap)
            else:
                t0 = time.monotonic()
                plan = self._receive_plan()
                seconds["quorum"] += time.monotonic() - t0
                outcome = self._attempt(plan, attempt, seconds)
            if outcome is not None:
                seconds["total"] = time.monotonic() - began
                self._report_step(outcome.step, seconds, tokens, sum_seq_len_sq)
                if self._on_commit is not None:
                    self._on_commit(outcome)
                return outcome
            if self.group.is_leader:
                self._pending = self._executor.submit(self._request_quorum, True)
        raise TooManyFailedCommits(
            f"replica {self.config.replica_id} failed to commit step {self.step} "
            f"{self.config.max_failed_commits} times in a row"
        )

    def _attempt(
        self,
        plan: StepPlan,
        attempt: int,
        seconds: dict[str, float],
        *,
        overlap: _Overlap | None = None,
    ) -> StepOutcome | None:
        """One exchange and vote; with `overlap`, the gradient hooks already checked the plan,
        rebuilt the ring and launched the exchange."""
        ring_error = overlap.ring_error if overlap is not None else None
        if overlap is None:
            ring_error = self._prepare(plan)
        if ring_error is not None:
            # A peer vanished (or the watch aborted us) while connecting: this attempt fails,
            # but the vote still happens, so the replica's ranks stay in step.
            log.warning("ring rebuild failed: %s", ring_error, extra=self._context())
            self._exchange.agree(False)
            return None
        recovering = self.step < plan.max_step
        fetch: Future[tuple[dict[str, torch.Tensor], dict[str, str | int]]] | None = None
        if recovering:
            fetch = self._executor.submit(self._fetch, plan)
            self._faults.hit("fetch", self.step)
        elif plan.serve or self._durable_due(plan):
            self._peer_state.publish(self.step, self._snapshot(), self._meta())
            self._faults.hit("serve", self.step)
        t0 = time.monotonic()
        timeout = self._exchange_timeout(plan)
        error: BaseException | None
        # Numbered by the step the healthy members train, the same on every member of the ring
        # (a recovering member's own step is behind it).
        self._telemetry.exchange_entered(plan.quorum_id, plan.max_step)
        if overlap is not None:
            error = self._exchange.wait(timeout)
        else:
            error = self._exchange.exchange(
                self._ring,
                contribute=not recovering,
                num_contributors=plan.num_healthy,
                timeout=timeout,
                starting=lambda: self._faults.hit("exchange", self.step),
            )
        seconds["exchange"] += time.monotonic() - t0
        self._telemetry.exchange_left()
        fetched = None
        if fetch is not None and error is not None:
            # This attempt fails anyway: do not wait out the fetch (its sources may be on
            # another quorum and never publish); it ends by itself within fetch_timeout.
            fetch.cancel()
        elif fetch is not None:
            t0 = time.monotonic()
            try:
                fetched = fetch.result()
            except (StateFetchError, TimeoutError) as exc:
                error = error or exc
            seconds["fetch"] += time.monotonic() - t0
        ok = error is None
        if not ok:
            log.warning(
                "exchange failed; retrying on a new quorum",
                extra=self._context(quorum_id=plan.quorum_id, error=str(error)),
            )
        if not self._exchange.agree(ok):
            return None
        self._faults.hit("commit", self.step)
        t0 = time.monotonic()
        if fetched is not None:
            self._load(*fetched, expected_step=plan.max_step)
        if self._durable_due(plan) and not recovering:
            self._peer_state.request_durable(self.step)
        outcome = self._commit(plan, attempt, recovering, seconds)
        seconds["commit"] = time.monotonic() - t0
        return outcome

    def _prepare(self, plan: StepPlan) -> RecoverableFtarError | None:
        """Checks the plan and rebuilds the ring for it; returns the error if the ring could not
        be built (the attempt fails, recoverably)."""
        if plan.max_step < self.step:
            raise RuntimeError(
                f"quorum max_step {plan.max_step} is behind this replica's {self.step}"
            )
        try:
            self._ensure_ring(plan)
        except RecoverableFtarError as exc:
            return exc
        return None

    # ---- overlapping the exchange with backward ----------------------------------------------

    def _on_grad(self, index: int) -> None:
        """Post-accumulate-grad hook of a param of bucket `index` (`overlap_backward`).

        The step's first hook receives the plan and rebuilds the ring; a bucket whose grads are
        all in is summed inside the replica and, once every lower bucket is out, launched on the
        ring. Every rank runs the same hooks in the same order (identical models), so the
        replica's collectives match. Errors are kept for `finish_step` to raise."""
        overlap = self._overlap
        if overlap is None:
            overlap = self._overlap = _Overlap(
                remaining=[len(params) for params in self._exchange.bucket_params]
            )
            try:
                self._begin_overlap(overlap)
            except Exception as exc:
                overlap.error = exc
        if overlap.error is not None:
            return
        try:
            overlap.remaining[index] -= 1
            if overlap.remaining[index] != 0:
                return
            self._exchange.capture_bucket(index)
            overlap.captured[index] = True
            if overlap.launching:
                launched = self._exchange.launched
                while launched < len(overlap.captured) and overlap.captured[launched]:
                    self._exchange.launch_through(launched)
                    launched += 1
        except Exception as exc:
            overlap.error = exc

    def _begin_overlap(self, overlap: _Overlap) -> None:
        self.start_step()
        t0 = time.monotonic()
        plan = self._receive_plan()
        overlap.quorum_s = time.monotonic() - t0
        overlap.plan = plan
        overlap.ring_error = self._prepare(plan)
        if overlap.ring_error is not None:
            return
        self._exchange.begin(
            self._ring,
            contribute=self.step >= plan.max_step,
            num_contributors=plan.num_healthy,
            starting=lambda: self._faults.hit("exchange", self.step),
        )
        overlap.launching = True

    def _commit(
        self, plan: StepPlan, attempt: int, recovered: bool, seconds: dict[str, float]
    ) -> StepOutcome:
        self._exchange.apply()
        scale = math.sqrt(plan.num_healthy / self.config.total_replicas)
        for group, base in zip(self.optimizer.param_groups, self._base_lrs, strict=True):
            group["lr"] = base * scale if self.config.scale_lr_by_healthy else base
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=False)
        trained = self.positions.advance(plan.healthy, self.samples_per_step)
        committed = self.step
        self.step += 1
        if self.group.is_leader and self._position_record_due():
            self._position_record = self._executor.submit(
                self._peer_state.record_positions, self.step, self.positions.copy()
            )
        outcome = StepOutcome(
            step=committed,
            quorum_id=plan.quorum_id,
            healthy=plan.healthy,
            recovered=recovered,
            trained=trained,
            attempts=attempt,
            seconds=seconds,
            without_control_plane=plan.fallback,
        )
        return outcome

    def _position_record_due(self) -> bool:
        """Leader, after committing: whether to send the positions to the sidecar now (at most
        once per `position_record_interval`; `shutdown` sends the last ones)."""
        interval = self.config.position_record_interval
        now = time.monotonic()
        if interval is None or now - self._positions_recorded < interval.total_seconds():
            return False
        if self._position_record is not None and not self._position_record.done():
            return False  # the previous one is still on its way: the next interval catches up
        self._positions_recorded = now
        return True

    def _record_last_positions(self) -> None:
        """Leader, on shutdown: the final positions, after the record before them (in order)."""
        if self.step == 0:
            return
        if self._position_record is not None:
            with contextlib.suppress(Exception):
                self._position_record.result(timeout=_RECORD_WAIT_S)
        self._peer_state.record_positions(self.step, self.positions)

    def _fetch(self, plan: StepPlan) -> tuple[dict[str, torch.Tensor], dict[str, str | int]]:
        """Catch-up, off the training thread: the healthy replicas' state of `max_step`."""
        self._faults.delay("slow_fetch", self.step)
        return self._peer_state.fetch_peer(plan.sources, plan.max_step)

    def _report_step(
        self, step: int, seconds: dict[str, float], tokens: int, sum_seq_len_sq: int
    ) -> None:
        started, self._step_started = self._step_started, None
        if not self._telemetry.enabled or started is None:
            return
        self._telemetry.step(
            step,
            started_at=started,
            committed=True,
            # Waiting on others (the quorum, the ring, a catch-up fetch) is not this replica's
            # own speed: the fail-slow detector subtracts it.
            exchange_s=seconds["quorum"] + seconds["exchange"] + seconds["fetch"],
            tokens=tokens,
            sum_seq_len_sq=sum_seq_len_sq,
        )
        if self._telemetry.wants_fingerprint(step):
            self._telemetry.fingerprint(step, fingerprint(self._snapshot()))

    # ---- quorum --------------------------------------------------------------------------

    def _request_quorum(self, commit_failed: bool) -> bytes:
        """Leader only, off the training thread: this step's quorum as the broadcast payload."""
        assert self._link is not None
        fallback = None
        if not commit_failed and self.config.control_plane_grace is not None:
            fallback = fallback_payload(self._plan, self._sent_plan, self.step)
        return self._link.request(self.step, commit_failed=commit_failed, fallback=fallback)

    def _exchange_timeout(self, plan: StepPlan) -> float:
        """The configured bound, or on a step trained without the quorum service twice the
        grace plus half a second: every member that also went on without the service decided
        within about one grace of the others, so a longer wait means some member is waiting on
        the service instead (or is dead) and this step cannot commit."""
        grace = self.config.control_plane_grace
        if plan.fallback and grace is not None:
            return 2 * grace.total_seconds() + 0.5
        return self.config.exchange_timeout.total_seconds()

    def _receive_plan(self) -> StepPlan:
        """The leader's quorum on every rank. In the steady state (only `max_step` moved on)
        the replica's ranks exchange just that number, in one small collective, and reuse
        their previous plan; any other change sends the whole plan."""
        payload = None
        header = None
        if self.group.is_leader:
            assert self._pending is not None
            payload = self._pending.result()
            self._pending = None
            steady = None if self._plan is None else steady_max_step(self._sent_plan, payload)
            header = [_STEADY, steady] if steady is not None else [len(payload), 0]
        kind, max_step = self.group.broadcast_ints(header, 2)
        if kind == _STEADY:
            if self._plan is None:
                raise RuntimeError("the leader sent a steady-state plan before any plan")
            plan = dataclasses.replace(self._plan, max_step=max_step)
        else:
            plan = decode_plan(
                self.group.broadcast_payload(payload, kind),
                replica_id=self.config.replica_id,
                rank=self.group.rank,
            )
            self._sent_plan = payload
        self._plan = plan
        return plan

    def _ensure_ring(self, plan: StepPlan) -> None:
        if self._ring.epoch == plan.quorum_id and not self._ring.broken:
            return
        position = plan.ring_replicas.index(self.config.replica_id)
        self._ring.reconfigure(list(plan.ring), position, plan.quorum_id)

    # ---- background threads ----------------------------------------------------------------

    def _watch(self) -> None:
        """Aborts the exchange as soon as the service evicts a replica of this rank's ring."""
        watcher = QuorumClient(self.config.quorum_address, self.config.token)
        while not self._stop.is_set():
            try:
                self._watch_stream = watcher.watch()
                for event in self._watch_stream:
                    if self._stop.is_set():
                        break
                    plan = self._plan
                    if (
                        event.kind in ("evicted", "left")
                        and plan is not None
                        and event.replica_id in plan.ring_replicas
                        and event.replica_id != self.config.replica_id
                    ):
                        log.info(
                            "ring member evicted; aborting the exchange",
                            extra=self._context(evicted=event.replica_id),
                        )
                        self._ring.abort()
            except Exception as exc:
                log.debug("watch stream ended: %s", exc, extra=self._context())
            self._stop.wait(0.2)
        watcher.close()

    # ---- state -------------------------------------------------------------------------------

    def _snapshot(self) -> dict[str, torch.Tensor]:
        return state_tensors(self.model, self.optimizer)

    def _meta(self) -> dict[str, str | int]:
        return {STEP_META: self.step, POSITIONS_META: self.positions.to_json()}

    def _load(
        self, tensors: dict[str, torch.Tensor], meta: dict[str, str | int], *, expected_step: int
    ) -> None:
        step = int(meta[STEP_META])
        if step != expected_step:
            raise StateFetchError(f"fetched state is at step {step}, expected {expected_step}")
        load_state_tensors(self.model, self.optimizer, tensors)
        self.positions = DataPositions.from_json(str(meta[POSITIONS_META]))
        self.step = step

    def _durable_due(self, plan: StepPlan) -> bool:
        every = self.config.durable_every_steps
        return (
            every > 0
            and self.step > 0
            and self.step % every == 0
            and bool(plan.healthy)
            and min(plan.healthy) == self.config.replica_id
        )

    def fingerprint(self) -> str:
        """sha256 of the replica's parameters and optimizer state (every rank's part, in rank
        order): equal on every healthy replica (I1). A collective: every rank must call it."""
        parts = self.group.all_gather_bytes(fingerprint(self._snapshot()).encode())
        return hashlib.sha256(b"|".join(parts)).hexdigest()

    def _context(self, **fields: object) -> dict[str, object]:
        return {
            "replica_id": self.config.replica_id,
            "rank": self.group.rank,
            "step": self.step,
            **fields,
        }

    # ---- shutdown ----------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Leaves the quorum gracefully and releases sockets and threads. Idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        for hook in self._hooks:
            hook.remove()
        if self._watch_stream is not None:
            self._watch_stream.cancel()
        if self.group.is_leader and self.config.position_record_interval is not None:
            self._record_last_positions()
        if self._link is not None:
            self._link.close()
        self._ring.close()
        self._telemetry.close()
        self._executor.shutdown(wait=False, cancel_futures=True)
