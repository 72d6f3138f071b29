"""The per-rank Manager: the FT-HSDP step protocol (DESIGN.md, steps 1–5).

Per step: the leader asks the quorum service for a quorum (overlapped with the forward pass) and
broadcasts it inside the replica; every rank rebuilds its FTAR ring on a new quorum id; the
replica's gradient is averaged across the healthy replicas; every rank votes, and only a unanimous
replica applies the optimizer step. A failed vote retries the exchange on the next quorum from the
intact local gradient. A replica behind the healthy ones contributes zeros while it fetches their
state (published as a snapshot before their optimizer step), then applies the same averaged
gradient and is identical to them (I1).

The user's loop stays a plain PyTorch loop (`OptimizerWrapper`): `zero_grad()` starts the step,
the end of `loss.backward()` runs the exchange and the vote (a callback queued by the gradient
hooks, as DDP does), so the averaged gradient is in `.grad` when backward returns and the user may
clip or unscale it; `optimizer.step()` commits the step and applies the user's optimizer."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta

import torch
from torch.autograd import Variable

from fthsdp.worker.config import ManagerConfig, lr_factor
from fthsdp.worker.data import DataPositions
from fthsdp.worker.exchange import GradientExchange
from fthsdp.worker.faults import FaultPlan
from fthsdp.worker.ftar import FtarConfig, FtarRing, RecoverableFtarError
from fthsdp.worker.manager_ring import (
    ensure_ring,
    exchange_timeout,
    gather_endpoints,
    ring_config,
)
from fthsdp.worker.metrics import WorkerMetrics
from fthsdp.worker.notice_relay import parent_of
from fthsdp.worker.peer_state import PeerState, StateFetchError
from fthsdp.worker.plan import StepPlan
from fthsdp.worker.plan_channel import PlanChannel
from fthsdp.worker.position_records import PositionRecords
from fthsdp.worker.quorum_link import QuorumLink, await_replicas
from fthsdp.worker.replica_group import ReplicaGroup
from fthsdp.worker.ring_watch import RingWatch, exit_for_restart
from fthsdp.worker.state import ReplicatedState, Stateful, fingerprint, state_digest
from fthsdp.worker.step import (
    WAITING_PHASES,
    AgreedStep,
    OverlapState,
    StepOutcome,
    TooManyFailedCommits,
)
from fthsdp.worker.step_account import StepAccount
from fthsdp.worker.step_meta import durable_due, read_state_meta, state_meta
from fthsdp.worker.telemetry import StepTelemetry

log = logging.getLogger(__name__)


class Manager:
    """One rank's part in fault-tolerant training. Create one per rank, after the model, the
    optimizer and any state that must travel with the replica (`state`: named objects with
    `state_dict()`/`load_state_dict()`, such as an LR scheduler or `RNGState(seed=...)`).

    Drive it with `OptimizerWrapper(manager)` in a plain loop (`zero_grad`, forward, `backward`,
    optional clipping, `step`, `scheduler.step`), or directly: `start_step()` before the forward
    pass, then `if manager.should_commit(): optimizer.step()` after backward."""

    def __init__(
        self,
        *,
        config: ManagerConfig,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        group: ReplicaGroup,
        samples_per_step: int,
        state: Mapping[str, Stateful] | None = None,
        ftar_config: FtarConfig | None = None,
        on_commit: Callable[[StepOutcome], None] | None = None,
        faults: FaultPlan | None = None,
    ) -> None:
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            raise TypeError(
                "pass the plain module, not a DistributedDataParallel: the Manager sums gradients "
                "inside the replica itself (FSDP2's fully_shard is supported)"
            )
        if samples_per_step < 1:
            raise ValueError("samples_per_step must be >= 1")
        self.config = config
        self.model = model
        self.optimizer = optimizer
        self.group = group
        self.samples_per_step = samples_per_step
        self.step = 0
        self.positions = DataPositions()
        self._state = ReplicatedState(model, optimizer, state)
        self._on_commit = on_commit
        self._faults = faults or FaultPlan([], None)
        self._exchange = GradientExchange(
            list(model.parameters()), group, bucket_bytes=config.bucket_bytes
        )
        if config.overlap_backward and self._exchange.sharded:
            raise ValueError("overlap_backward is not supported with sharded (DTensor) params")
        self._overlap: OverlapState | None = None
        self._synced: AgreedStep | None = None
        self._last_outcome: StepOutcome | None = None
        self._callback_queued = False
        self._no_sync = 0
        self._account = StepAccount(even=config.micro_steps, max_micro_steps=config.max_micro_steps)
        self._hooks = [
            param.register_post_accumulate_grad_hook(  # type: ignore[no-untyped-call]
                lambda _param, index=index: self._on_grad(index)
            )
            for index, params in enumerate(self._exchange.bucket_params)
            for param in params
        ]
        self._ring = FtarRing(ring_config(config, ftar_config))
        self._peer_state = PeerState(config=config, rank=group.rank, world_size=group.world_size)
        self._executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="fthsdp-manager")
        self._stop = threading.Event()
        self._fetch_cancel = threading.Event()
        """Set to stop the catch-up fetch in flight (its attempt failed, or the manager closes)."""
        self._relay, self._endpoints, relays = gather_endpoints(group, self._ring.address, config)
        self._records = (
            PositionRecords(self._peer_state, self._executor, config.position_record_interval)
            if group.is_leader and config.position_record_interval is not None
            else None
        )
        self._telemetry = StepTelemetry(
            config.health_address,
            config.token,
            replica_id=config.replica_id,
            rank=group.rank,
            fingerprint_every_steps=config.fingerprint_every_steps,
        )
        self.metrics = WorkerMetrics.of_rank(config, is_leader=group.is_leader)
        """The leader's Prometheus metrics (`ManagerConfig.metrics_port`), else None."""
        # Restore before joining: a joined replica is silent until its heartbeats and Watch
        # stream start below, and a real model's checkpoint takes longer to load than the
        # service's heartbeat timeout, which would evict it for silence.
        self._restore_durable()
        self._link = QuorumLink(config, self._endpoints, self._stop) if group.is_leader else None
        self._plans = PlanChannel(config, group, self._link)
        self._watch = RingWatch(
            config,
            ring=self._ring,
            plan=lambda: self._plans.plan,
            stop=self._stop,
            rank=group.rank,
            on_teardown=(
                functools.partial(exit_for_restart, group, self._context, self._telemetry.leave)
                if config.exit_on_teardown
                else None
            ),
            relay=self._relay,
            upstream=None if (parent := parent_of(group.rank)) is None else relays[parent],
            incarnation=None if self._link is None else self._link.current_incarnation,
        )
        self._threads = [self._watch.thread]
        if self._link is not None:
            self._threads.append(
                threading.Thread(
                    target=self._link.heartbeat_loop,
                    args=(self._watch,),
                    name="fthsdp-heartbeat",
                    daemon=True,
                )
            )
        for thread in self._threads:
            thread.start()
        if self._link is not None and config.await_replicas > timedelta(0):
            await_replicas(config, self._stop)

    # ---- setup ---------------------------------------------------------------------------

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

    # ---- the step: the public surface ---------------------------------------------------------

    def start_step(self) -> None:
        """Starts a step: the leader's quorum request goes out so that it overlaps the forward
        pass. `OptimizerWrapper.zero_grad` calls it; a backward not preceded by it starts the
        step itself (then the request no longer overlaps the forward). A step the replica agreed
        on but whose `should_commit` was never called (a GradScaler that skipped the optimizer
        step on an overflow) is committed here: its samples were trained, with no update."""
        if self._synced is not None:
            self._commit_synced()
        self._account.start()
        self._plans.request(self.step, work=self._account.request())

    @property
    def micro_steps(self) -> int:
        """How many micro-steps this replica trains in the current step: forward and backward
        passes, all but the last inside `no_sync()`, each over the next batch of the loader.
        `ManagerConfig.micro_steps` unless the quorum service's fail-slow planner moved some
        (it may be 0: then the step runs no backward and just calls `optimizer.step()`)."""
        return self._account.micro_steps

    def should_commit(self) -> bool:
        """Whether to apply the optimizer step now; call it after backward (the wrapper's
        `step()` does). It returns True once every rank of the replica voted that its exchange
        completed: `.grad` holds the gradient averaged over the healthy replicas, and the step,
        its data positions and its catch-up are committed. A failed exchange is not skipped: it
        is retried on the next quorum from the intact local gradient, without recomputing, and
        after `max_failed_commits` failures in a row this raises `TooManyFailedCommits` (the
        replica should exit and be restarted); without a quorum it raises `NoQuorumError`.

        Raises RuntimeError when no step is in progress (no `start_step()`/`zero_grad()` or
        backward since the last commit)."""
        if self._synced is None:
            if self._account.started is None and self._overlap is None:
                raise RuntimeError(
                    "no step in progress: call optimizer.zero_grad() (or manager.start_step()) "
                    "and backward before optimizer.step() / should_commit()"
                )
            self._sync()
        self._commit_synced()
        return True

    def lr_factor(self) -> float:
        """The learning-rate factor of `ManagerConfig.lr_policy` for the step committed last
        (1.0 before any): `OptimizerWrapper.step` applies it around the optimizer step."""
        outcome = self._last_outcome
        if outcome is None:
            return 1.0
        return lr_factor(self.config.lr_policy, len(outcome.healthy), self.config.total_replicas)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradient accumulation: backward passes inside the block only accumulate local
        gradients (FSDP2 modules skip their reduce-scatter too); the first backward after it
        exchanges the sum."""
        from torch.distributed.fsdp import FSDPModule  # costs a second to import: only here

        fsdp = [m for m in self.model.modules() if isinstance(m, FSDPModule)]
        self._no_sync += 1
        for module in fsdp:
            module.set_requires_gradient_sync(False, recurse=False)
        try:
            yield
        finally:
            self._no_sync -= 1
            if self._no_sync == 0:
                for module in fsdp:
                    module.set_requires_gradient_sync(True, recurse=False)

    def report_work(self, *, tokens: int, sum_seq_len_sq: int) -> None:
        """This rank's work in the current step, for the health service's fail-slow predictor:
        tokens and Σ l² over its sequences. Optional; the last call of a step counts."""
        self._account.report_work(tokens, sum_seq_len_sq)

    @property
    def last_outcome(self) -> StepOutcome | None:
        """What the last committed step did, or None before the first."""
        return self._last_outcome

    # ---- the step: exchange, vote, commit -------------------------------------------------------

    def _on_grad(self, index: int) -> None:
        """Post-accumulate-grad hook of every trainable param (bucket `index`): the first one of
        a backward queues the exchange to run when backward ends, as DDP does (FSDP2 runs these
        hooks after its reduce-scatter, and its own end-of-backward callback is queued before
        ours). With `overlap_backward` it also sends buckets while backward runs."""
        if self._no_sync or self._stop.is_set():
            return
        if self._synced is not None:
            raise RuntimeError(
                "a second backward in one step: the first already exchanged the gradient; "
                "accumulate inside `with manager.no_sync():` and let the last backward sync"
            )
        if not self._callback_queued:
            self._callback_queued = True
            Variable._execution_engine.queue_callback(self._end_of_backward)
        if self.config.overlap_backward:
            self._overlap_grad(index)

    def _end_of_backward(self) -> None:
        self._callback_queued = False
        self._sync()

    def _sync(self) -> None:
        """Exchanges the gradient and votes until the replica agrees (see `should_commit`),
        then writes the averaged gradient into `.grad`."""
        began = time.monotonic()
        seconds = {phase: 0.0 for phase in (*WAITING_PHASES, "serve", "commit")}
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
            seconds["ring"] += overlap.ring_s
            seconds["serve"] += overlap.serve_s
        for attempt in range(1, self.config.max_failed_commits + 1):
            if attempt == 1 and overlap is not None:
                assert overlap.plan is not None  # else the hooks kept an error, raised above
                plan = overlap.plan
                recovering = self._attempt(plan, seconds, overlap=overlap)
            else:
                t0 = time.monotonic()
                plan = self._plans.receive()
                seconds["quorum"] += time.monotonic() - t0
                recovering = self._attempt(plan, seconds)
            if recovering is not None:
                self._exchange.apply(plan.gradient_scale())
                self._synced = AgreedStep(
                    plan=plan, attempt=attempt, recovered=recovering, seconds=seconds, began=began
                )
                return
            if self.metrics is not None:
                self.metrics.failed_attempts.inc()
            self._plans.request(self.step, commit_failed=True, work=self._account.request())
        raise TooManyFailedCommits(
            f"replica {self.config.replica_id} failed to commit step {self.step} "
            f"{self.config.max_failed_commits} times in a row"
        )

    def _attempt(
        self,
        plan: StepPlan,
        seconds: dict[str, float],
        *,
        overlap: OverlapState | None = None,
    ) -> bool | None:
        """One exchange and vote; with `overlap`, the gradient hooks already checked the plan,
        rebuilt the ring and launched the exchange. Returns None if the replica did not agree,
        else whether this rank caught up from peers in this step (its state is loaded)."""
        ring_error = overlap.ring_error if overlap is not None else None
        if overlap is None:
            t0 = time.monotonic()
            ring_error = self._prepare(plan)
            seconds["ring"] += time.monotonic() - t0
        if ring_error is not None:
            # A peer vanished (or the watch aborted us) while connecting: this attempt fails,
            # but the vote still happens, so the replica's ranks stay in step.
            log.warning("ring rebuild failed: %s", ring_error, extra=self._context())
            self._exchange.agree(False)
            return None
        recovering = self.step < plan.max_step
        fetch: Future[tuple[dict[str, torch.Tensor], dict[str, str | int]]] | None = None
        sources_in = threading.Event()
        if recovering:
            self._fetch_cancel = threading.Event()
            fetch = self._executor.submit(self._fetch, plan, self._fetch_cancel, sources_in)
            self._faults.hit("fetch", self.step)
        elif overlap is None:  # with overlap, the hooks served before launching the exchange
            seconds["serve"] += self._serve(plan)
        # Before t0: a straggler's lateness is its own time, not waiting on others (the
        # fail-slow detector subtracts the exchange phase as waiting).
        self._faults.slow(self.step)
        t0 = time.monotonic()
        timeout = exchange_timeout(self.config, plan)
        error: BaseException | None
        # Numbered by the step the healthy members train, the same on every member of the ring
        # (a recovering member's own step is behind it).
        self._faults.hang(self.step)
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
        if self._telemetry.enabled:  # the ring's counters and left neighbour: for it alone
            self._telemetry.exchange_left(self._ring.stats(), plan.left_of(self.config.replica_id))
        fetched = None
        if fetch is not None and error is not None:
            # This attempt fails anyway: do not wait out the fetch (its sources may be on
            # another quorum and never publish). A transfer under way ends within its deadline.
            self._fetch_cancel.set()
            fetch.cancel()
        elif fetch is not None:
            # Every source entered this exchange, so it published (or failed to) before: a
            # snapshot still missing will not come, and the fetch stops waiting for it.
            sources_in.set()
            t0 = time.monotonic()
            try:
                fetched = fetch.result()
            except (StateFetchError, TimeoutError) as exc:
                error = error or exc
            seconds["fetch"] += time.monotonic() - t0
        ok = error is None
        if not ok:
            log.warning(
                "step %d failed on quorum %d (%s); retrying on a new quorum",
                self.step,
                plan.quorum_id,
                error,
                extra=self._context(quorum_id=plan.quorum_id, error=str(error)),
            )
        t0 = time.monotonic()
        agreed = self._exchange.agree(ok)
        # A rank whose own ring finished first waits here for the replica's other ranks.
        seconds["vote"] += time.monotonic() - t0
        if not agreed:
            return None
        self._faults.hit("commit", self.step)
        t0 = time.monotonic()
        if fetched is not None:
            self._load(*fetched, expected_step=plan.max_step)
        if durable_due(self.config, self.step, plan) and not recovering:
            self._peer_state.request_durable(self.step)
        seconds["commit"] = time.monotonic() - t0
        return recovering

    def _prepare(self, plan: StepPlan) -> RecoverableFtarError | None:
        """Checks the plan and rebuilds the ring for it; returns the error if the ring could not
        be built (the attempt fails, recoverably)."""
        if plan.max_step < self.step:
            raise RuntimeError(
                f"quorum max_step {plan.max_step} is behind this replica's {self.step}"
            )
        try:
            ensure_ring(self._ring, self._watch, plan, self.config.replica_id)
        except RecoverableFtarError as exc:
            return exc
        return None

    def _commit_synced(self) -> StepOutcome:
        """Commits the agreed step: data positions, step counter, records, telemetry."""
        synced, self._synced = self._synced, None
        assert synced is not None
        plan = synced.plan
        micro = plan.micro_steps
        trained = self.positions.advance_by(
            {r: micro.trained_by(r) * self.samples_per_step for r in plan.healthy}
        )
        committed = self.step
        self.step += 1
        if self._records is not None:
            self._records.committed(self.step, self.positions)
        outcome = synced.outcome(committed, trained)
        seconds = outcome.seconds
        self._last_outcome = outcome
        cost = self._account.committed(seconds, micro.next_for(self.config.replica_id))
        if cost is not None:
            state = self._state
            self._telemetry.committed(
                committed,
                cost,
                quorum_id=plan.quorum_id,
                digest=lambda: state_digest(state.core_tensors()),
            )
        if self.metrics is not None:
            self.metrics.committed(
                seconds=seconds,
                healthy=plan.num_healthy,
                recovered=synced.recovered,
                exchange_bytes=self._exchange.share_bytes,
            )
        if self._on_commit is not None:
            self._on_commit(outcome)
        return outcome

    # ---- overlapping the exchange with backward ----------------------------------------------

    def _overlap_grad(self, index: int) -> None:
        """`overlap_backward`: a param of bucket `index` has its gradient.

        The step's first hook receives the plan and rebuilds the ring; a bucket whose grads are
        all in is summed inside the replica and, once every lower bucket is out, launched on the
        ring. Every rank runs the same hooks in the same order (identical models), so the
        replica's collectives match. Errors are kept for the end of backward to raise."""
        overlap = self._overlap
        if overlap is None:
            overlap = self._overlap = OverlapState(
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

    def _begin_overlap(self, overlap: OverlapState) -> None:
        self.start_step()
        t0 = time.monotonic()
        plan = self._plans.receive()
        overlap.quorum_s = time.monotonic() - t0
        overlap.plan = plan
        t0 = time.monotonic()
        overlap.ring_error = self._prepare(plan)
        overlap.ring_s = time.monotonic() - t0
        if overlap.ring_error is not None:
            return
        if self.step >= plan.max_step:
            overlap.serve_s = self._serve(plan)
        self._exchange.begin(
            self._ring,
            contribute=self.step >= plan.max_step,
            num_contributors=plan.num_healthy,
            starting=lambda: self._faults.hit("exchange", self.step),
        )
        overlap.launching = True

    def _serve(self, plan: StepPlan) -> float:
        """A healthy rank publishes its state for the plan's recovering peers (or a durable
        checkpoint) before it enters the exchange, whatever the mode: a peer whose exchange
        completed knows every source's publish is behind it. Returns the seconds it took."""
        if not (plan.serve or durable_due(self.config, self.step, plan)):
            return 0.0
        t0 = time.monotonic()
        self._peer_state.publish(
            self.step, self._state.tensors(), state_meta(self.step, self.positions)
        )
        self._faults.hit("serve", self.step)
        return time.monotonic() - t0

    def _fetch(
        self, plan: StepPlan, cancelled: threading.Event, sources_in: threading.Event
    ) -> tuple[dict[str, torch.Tensor], dict[str, str | int]]:
        """Catch-up, off the training thread: the healthy replicas' state of `max_step`."""
        self._faults.delay("slow_fetch", self.step)
        return self._peer_state.fetch_peer(
            plan.sources, plan.max_step, cancelled=cancelled, sources_in=sources_in
        )

    # ---- state -------------------------------------------------------------------------------

    def _load(
        self, tensors: dict[str, torch.Tensor], meta: dict[str, str | int], *, expected_step: int
    ) -> None:
        positions = read_state_meta(meta, expected_step=expected_step)
        self._state.load(tensors)
        self.positions = positions
        self.step = expected_step

    def fingerprint(self) -> str:
        """sha256 of the replica's parameters and optimizer state (every rank's part, in rank
        order): equal on every healthy replica (I1). A collective: every rank must call it."""
        parts = self.group.all_gather_bytes(fingerprint(self._state.core_tensors()).encode())
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
        self._watch.close()
        if self._records is not None:
            self._records.close(self.step, self.positions)
        if self._link is not None:
            self._link.close()
        self._ring.close()
        self._telemetry.close()
        if self.metrics is not None:
            self.metrics.close()
        self._plans.close()
        self._fetch_cancel.set()
        self._executor.shutdown(wait=False, cancel_futures=True)
        for thread in self._threads:  # so no gRPC call of theirs is left when the process exits
            thread.join(timeout=2)
