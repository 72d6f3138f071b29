"""Training quality at equal tokens when replicas fail, and which learning-rate policy on a shrink
(`sqrt`, `linear`, `none`) trains best.

    python -m fthsdp.bench.quality --replicas 3 --steps 800 --outages 4 --seeds 0,1,2 \
        --policies sqrt,linear,none --json runs/bench/quality.json

The FT-HSDP paper reports no distinguishable loss difference at equal tokens with replicas failing,
and that scaling the learning rate by sqrt(healthy / total) on a shrink beats linear scaling. This
benchmark asks the same question of this project's update rule on the demo's tiny GPT.

Method: a single-process emulation of the update rule, which is faithful because every healthy
replica holds bitwise-identical state (invariant I1, asserted by the end-to-end tests). The job
therefore behaves as ONE model whose step-n gradient is the average, over the replicas healthy at
step n, of each one's micro-batch gradient (FTAR sums the contributions and divides by the number
of contributors). A down or recovering replica contributes nothing; when it comes back it copies a
healthy peer's state, which here is the one model, so nothing is left to emulate. Each replica's
data position advances only on the steps it contributed to (invariant I2: `worker.data`), so no
sample is skipped or repeated; a returning replica resumes its shard where it stopped. Per step:

1. for each healthy replica r: the gradient of its micro-batch, global ids
   `ShardSpec(replica_index=r, total_replicas=R, ...).sample_ids(position_r)`, accumulated
   (backward adds into .grad), then divided by the number of healthy replicas;
2. the scheduler's learning rate times `worker.config.lr_factor(policy, healthy, R)` for this
   optimizer step only, then restored, exactly as `worker.optim.OptimizerWrapper.step` does;
3. AdamW step, scheduler step (linear warmup, then constant), contributors' positions advance.

Tokens of a step = healthy x micro-batch x block size. `--steps` counts fault-free steps and sets
the token budget (steps x R x micro-batch x block size); a run with failures sees fewer tokens per
step, so it trains for more steps until it has seen at least as many tokens (it stops at the first
step at or past the budget: it overshoots by less than one step). Failures: `--outages` outages of
`--outage-steps` steps each (by default `--down-fraction` of `--steps` in all), each taking down one
seeded-random replica, one per equal slot of the first `--steps` steps at a seeded-random start
inside the slot, so they never overlap and are spread over the run. For every seed, `fault-free`
and one run per policy start from the same initial weights (`build_model(..., seed)`) and the same
data stream, and the runs with failures share one schedule; a seed also shifts the sample ids (by
seed x 1,000,003), so seeds differ in initial weights, data order and failure schedule.

Evaluation: the mean cross-entropy on a fixed held-out set, windows evenly spaced over the last
`--holdout-chars` characters of the corpus; training samples are drawn only from the text before
them, so no evaluated window was trained on. It is measured at equal token counts: before training
and then at the first step whose cumulative tokens reach each multiple of `--eval-every-tokens`,
and at the budget (the tokens actually seen are recorded next to each mark). The training loss
(mean over the step's contributors) is recorded per step.

Prints a table per run kind: the final held-out loss at equal tokens (median and min-max over
seeds), its paired per-seed difference from fault-free (absolute and %), and the fault-free
seed-to-seed spread, so a reader can tell whether a difference is distinguishable from noise.
Writes a JSON file with every number (config, failure schedules, per-seed per-step curves,
summary) and a PNG of held-out loss vs tokens (`bench.quality_render` makes the summary, the table
and the plot). Not a pass/fail test."""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import shlex
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch.optim.lr_scheduler import LambdaLR

from fthsdp.bench.quality_render import FAULT_FREE, render, summarize, write_plot
from fthsdp.deploy.demo.corpus import CORPUS_PATH, CharDataset
from fthsdp.deploy.demo.model import TinyGPT, TinyGPTConfig, build_model
from fthsdp.worker.config import LR_POLICIES, lr_factor
from fthsdp.worker.data import ShardSpec

DEFAULT_JSON = Path("runs/bench/quality.json")
# The fault-free runs still go through lr_factor with this policy: were a step ever counted as
# shrunken by mistake, its factor would show it (with all replicas healthy it is 1 for any policy).
FAULT_FREE_POLICY = "sqrt"
SEED_ID_OFFSET = 1_000_003
"""Sample ids of seed s are shifted by s x this (prime), so seeds also differ in data order."""
QUICK = {
    "replicas": 2,
    "steps": 30,
    "seeds": "0",
    "outages": 1,
    "warmup_steps": 5,
    "eval_samples": 32,
}
"""What `--quick` changes (flags given explicitly still win): seconds, for tests."""


# ---------------------------------------------------------------------------------------------
# Command line


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, default=3, help="replicas R (units of failure)")
    p.add_argument("--micro-batch", type=int, default=4, help="samples per replica per step")
    p.add_argument("--block-size", type=int, default=64, help="tokens per sample (context)")
    p.add_argument(
        "--steps", type=int, default=800, help="fault-free steps; sets the token budget of all runs"
    )
    p.add_argument("--outages", type=int, default=4, help="outages per faulty run (one replica)")
    p.add_argument(
        "--outage-steps", type=int, default=0, help="steps per outage (0: from --down-fraction)"
    )
    p.add_argument(
        "--down-fraction",
        type=float,
        default=0.2,
        help="fraction of --steps with one replica down, when --outage-steps is 0",
    )
    p.add_argument("--policies", default="sqrt,linear,none", help="comma-separated lr policies")
    p.add_argument("--seeds", default="0,1,2", help="comma-separated seeds (init, data, failures)")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW base learning rate")
    p.add_argument("--warmup-steps", type=int, default=20, help="linear lr warmup (steps)")
    p.add_argument(
        "--eval-every-tokens",
        type=int,
        default=0,
        help="held-out evaluation period in tokens (0: 16 evaluations over the budget)",
    )
    p.add_argument("--eval-samples", type=int, default=128, help="held-out windows evaluated")
    p.add_argument(
        "--holdout-chars", type=int, default=20_000, help="corpus tail kept out of training (chars)"
    )
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--quick", action="store_true", help=f"tiny sizes for tests: {QUICK}")
    p.add_argument("--json", type=Path, default=DEFAULT_JSON, help="write every number here")
    p.add_argument("--plot", type=Path, default=None, help="PNG path (default: next to --json)")
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = _parser()
    if p.parse_known_args(argv)[0].quick:
        p.set_defaults(**QUICK)  # defaults only, so explicit flags still override --quick
    args = p.parse_args(argv)
    args.policies = [x.strip() for x in args.policies.split(",") if x.strip()]
    args.seeds = [int(x) for x in args.seeds.split(",") if x.strip()]
    if any(policy not in LR_POLICIES for policy in args.policies):
        p.error(f"--policies must be drawn from {LR_POLICIES}")
    if args.replicas < 2:
        p.error("--replicas must be >= 2 (one must survive an outage)")
    if min(args.micro_batch, args.block_size, args.steps, args.eval_samples) < 1 or not args.seeds:
        p.error("--micro-batch, --block-size, --steps, --eval-samples and --seeds must be >= 1")
    if min(args.outages, args.outage_steps, args.eval_every_tokens, args.warmup_steps) < 0:
        p.error("--outages, --outage-steps, --eval-every-tokens and --warmup-steps must be >= 0")
    if not 0 <= args.down_fraction < 1:
        p.error("--down-fraction must be in [0, 1)")
    if args.outage_steps == 0 and args.outages:
        args.outage_steps = max(1, round(args.down_fraction * args.steps / args.outages))
    if args.outages * args.outage_steps > args.steps:
        p.error("outages x outage steps must fit in --steps")
    if args.plot is None:
        args.plot = args.json.with_suffix(".png")
    return args


# ---------------------------------------------------------------------------------------------
# Failure schedule


@dataclass(frozen=True, kw_only=True, slots=True)
class Outage:
    """Replica `replica` is down (contributes nothing) for steps [start, start + length)."""

    replica: int
    start: int
    length: int

    @property
    def end(self) -> int:
        return self.start + self.length

    def covers(self, step: int) -> bool:
        return self.start <= step < self.end


def outage_schedule(
    *, seed: int, replicas: int, steps: int, outages: int, outage_steps: int
) -> list[Outage]:
    """`outages` outages of `outage_steps` steps, each of one seeded-random replica. The first
    `steps` steps are cut into equal slots and each outage starts at a seeded-random step of its
    own slot: they never overlap (so R-1 replicas are always healthy) and are spread over the run
    instead of bunched. A pure function of its arguments."""
    if outages == 0 or outage_steps == 0:
        return []
    slot = steps // outages
    if outage_steps > slot:
        raise ValueError(f"{outages} outages of {outage_steps} steps do not fit in {steps} steps")
    rng = random.Random(f"fthsdp-bench-quality-{seed}")  # str seeds hash stably across runs
    schedule = []
    for i in range(outages):
        start = rng.randint(i * slot, (i + 1) * slot - outage_steps)
        schedule.append(Outage(replica=rng.randrange(replicas), start=start, length=outage_steps))
    return schedule


def healthy_at(step: int, schedule: Sequence[Outage], replicas: int) -> list[int]:
    """Replica indices that contribute to `step`."""
    return [
        r for r in range(replicas) if not any(o.replica == r and o.covers(step) for o in schedule)
    ]


# ---------------------------------------------------------------------------------------------
# Data


def load_data(block_size: int, holdout_chars: int) -> tuple[CharDataset, str]:
    """The training dataset over the corpus minus its tail, and the tail (held out)."""
    text = CORPUS_PATH.read_text(encoding="utf-8")
    if not 0 < holdout_chars < len(text) // 2:
        raise ValueError(f"--holdout-chars must be in 1..{len(text) // 2 - 1}")
    train = CharDataset(block_size=block_size, text=text[:-holdout_chars])
    # The vocabulary is the sorted character set of the text given: the held-out tail must not
    # add characters, or its ids would not mean the same to the model.
    if train.chars != CharDataset(block_size=block_size, text=text).chars:
        raise ValueError("the held-out tail has characters the training text lacks")
    return train, text[-holdout_chars:]


def eval_batch(data: CharDataset, tail: str, samples: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`samples` windows evenly spaced over the held-out tail, as (x, y)."""
    ids = torch.tensor(data.encode(tail), dtype=torch.int64)
    last_start = len(ids) - data.block_size - 1
    if last_start < 0:
        raise ValueError("held-out tail shorter than one window")
    starts = [round(i * last_start / max(1, samples - 1)) for i in range(samples)]
    return data.collate([ids[s : s + data.block_size + 1] for s in starts])


# ---------------------------------------------------------------------------------------------
# One training run


@dataclass(frozen=True, kw_only=True, slots=True)
class Setup:
    """What every run of one invocation shares."""

    replicas: int
    micro_batch: int
    lr: float
    warmup_steps: int
    target_tokens: int
    eval_marks: tuple[int, ...]
    max_steps: int


class Emulation:
    """The one model of the job, its optimizer and scheduler, and every replica's data position."""

    def __init__(self, setup: Setup, data: CharDataset, seed: int, policy: str) -> None:
        config = TinyGPTConfig(vocab_size=data.vocab_size, block_size=data.block_size)
        self.model: TinyGPT = build_model(config, seed=seed)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=setup.lr)
        warmup = max(1, setup.warmup_steps)
        self.scheduler = LambdaLR(self.optimizer, lambda s: min(1.0, (s + 1) / warmup))
        self.setup, self.data, self.policy = setup, data, policy
        self.id_offset = seed * SEED_ID_OFFSET
        self.specs = [
            ShardSpec(
                replica_index=r,
                total_replicas=setup.replicas,
                rank=0,
                world_size=1,
                micro_batch=setup.micro_batch,
            )
            for r in range(setup.replicas)
        ]
        self.positions = [0] * setup.replicas
        self.trained_ids: list[int] = []

    def _gradient_sum(self, healthy: Sequence[int]) -> float:
        """Accumulates into .grad the sum over `healthy` of each replica's micro-batch gradient
        (what FTAR reduces); returns their mean micro-batch loss."""
        total = 0.0
        for r in healthy:
            ids = self.specs[r].sample_ids(self.positions[r])
            self.trained_ids.extend(ids)
            x, y = self.data.collate([self.data.sample(self.id_offset + i) for i in ids])
            _, loss = self.model(x, y)
            assert loss is not None
            loss.backward()
            total += float(loss.detach())
        return total / len(healthy)

    def step(self, healthy: Sequence[int]) -> tuple[float, float, float]:
        """One committed step trained by `healthy`: (train loss, lr factor, lr used)."""
        self.optimizer.zero_grad(set_to_none=True)
        loss = self._gradient_sum(healthy)
        with torch.no_grad():
            for p in self.model.parameters():
                if p.grad is not None:
                    p.grad.div_(len(healthy))  # FTAR's average over the contributors
        factor = lr_factor(self.policy, len(healthy), self.setup.replicas)
        saved = [group["lr"] for group in self.optimizer.param_groups]
        for group, lr in zip(self.optimizer.param_groups, saved, strict=True):
            group["lr"] = lr * factor  # this step only, as OptimizerWrapper.step does
        self.optimizer.step()
        for group, lr in zip(self.optimizer.param_groups, saved, strict=True):
            group["lr"] = lr
        self.scheduler.step()
        for r in healthy:  # only contributors advance: nothing skipped, nothing repeated
            self.positions[r] += self.specs[r].samples_per_step
        return loss, factor, saved[0] * factor

    @torch.no_grad()
    def eval_loss(self, xy: tuple[torch.Tensor, torch.Tensor]) -> float:
        _, loss = self.model(*xy)
        assert loss is not None
        return float(loss)

    def exactly_once(self) -> bool:
        """True if the ids trained are exactly each replica's shard prefix up to its position."""
        expected = [
            i
            for spec, pos in zip(self.specs, self.positions, strict=True)
            for p in range(0, pos, spec.samples_per_step)
            for i in spec.sample_ids(p)
        ]
        return sorted(self.trained_ids) == sorted(expected)


def _record_evals(
    emu: Emulation, xy: tuple[torch.Tensor, torch.Tensor], tokens: int, step: int, out: list[Any]
) -> None:
    """Evaluates once for every mark that `tokens` has reached and is not yet recorded."""
    marks = emu.setup.eval_marks
    if len(out) < len(marks) and tokens >= marks[len(out)]:
        loss = emu.eval_loss(xy)
        while len(out) < len(marks) and tokens >= marks[len(out)]:
            out.append({"mark": marks[len(out)], "tokens": tokens, "step": step, "loss": loss})


def _late_mean(evals: Sequence[dict[str, Any]], target: int) -> float:
    """Mean held-out loss over the marks in the last quarter of the token budget."""
    late = [e["loss"] for e in evals if e["mark"] >= 0.75 * target]
    return statistics.fmean(late)


def train_run(
    setup: Setup,
    data: CharDataset,
    xy: tuple[torch.Tensor, torch.Tensor],
    *,
    seed: int,
    policy: str,
    schedule: Sequence[Outage],
) -> dict[str, Any]:
    """Trains until the token budget is reached; every per-step number and every evaluation."""
    started = time.perf_counter()
    emu = Emulation(setup, data, seed, policy)
    # Per step: contributors, lr factor, lr used, mean train loss, cumulative tokens after it.
    curve: dict[str, list[Any]] = {
        k: [] for k in ("healthy", "lr_factor", "lr", "train_loss", "tokens")
    }
    evals: list[dict[str, Any]] = []
    tokens, step = 0, 0
    _record_evals(emu, xy, tokens, step, evals)  # the mark at 0 tokens: the initial model
    while tokens < setup.target_tokens:
        if step >= setup.max_steps:
            raise RuntimeError(f"token budget not reached in {setup.max_steps} steps")
        healthy = healthy_at(step, schedule, setup.replicas)
        loss, factor, lr = emu.step(healthy)
        tokens += len(healthy) * setup.micro_batch * data.block_size
        step += 1
        for key, value in zip(curve, (len(healthy), factor, lr, loss, tokens), strict=True):
            curve[key].append(value)
        _record_evals(emu, xy, tokens, step, evals)
    return {
        "policy": policy,
        "steps": step,
        "tokens": tokens,
        "down_replica_steps": step * setup.replicas - sum(curve["healthy"]),
        "exactly_once": emu.exactly_once(),
        "positions": list(emu.positions),
        "final_eval_loss": evals[-1]["loss"],
        "late_eval_loss": _late_mean(evals, setup.target_tokens),
        "evals": evals,
        "per_step": curve,
        "wall_s": time.perf_counter() - started,
    }


# ---------------------------------------------------------------------------------------------
# The whole benchmark


def _setup(args: argparse.Namespace) -> Setup:
    step_tokens = args.replicas * args.micro_batch * args.block_size
    target = args.steps * step_tokens
    every = args.eval_every_tokens or max(step_tokens, target // 16)
    marks = (*range(0, target, every), target)
    # With one replica down, a step has (R-1)/R of the tokens; twice that bound is never hit.
    max_steps = 2 * math.ceil(args.steps * args.replicas / (args.replicas - 1)) + 1
    return Setup(
        replicas=args.replicas,
        micro_batch=args.micro_batch,
        lr=args.lr,
        warmup_steps=args.warmup_steps,
        target_tokens=target,
        eval_marks=marks,
        max_steps=max_steps,
    )


def _config(args: argparse.Namespace, setup: Setup, names: Sequence[str]) -> dict[str, Any]:
    return {
        **{k: str(v) if isinstance(v, Path) else v for k, v in sorted(vars(args).items())},
        "target_tokens": setup.target_tokens,
        "eval_marks": list(setup.eval_marks),
        "down_fraction_of_steps": args.outages * args.outage_steps / args.steps,
        "fault_free_policy": FAULT_FREE_POLICY,
        "run_names": list(names),
        "eval_set": f"{args.eval_samples} windows evenly spaced over the corpus's last "
        f"{args.holdout_chars} characters, which training never samples",
    }


def _machine() -> dict[str, Any]:
    return {
        "nproc": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }


def run_all(args: argparse.Namespace) -> dict[str, Any]:
    """Every seed: the fault-free run, then one run per policy on that seed's schedule."""
    setup = _setup(args)
    data, tail = load_data(args.block_size, args.holdout_chars)
    xy = eval_batch(data, tail, args.eval_samples)
    names = [FAULT_FREE, *args.policies]
    runs: dict[str, dict[str, Any]] = {}
    schedules: dict[str, list[dict[str, int]]] = {}
    for seed in args.seeds:
        schedule = outage_schedule(
            seed=seed,
            replicas=args.replicas,
            steps=args.steps,
            outages=args.outages,
            outage_steps=args.outage_steps,
        )
        schedules[str(seed)] = [asdict(o) for o in schedule]
        runs[str(seed)] = {
            FAULT_FREE: train_run(setup, data, xy, seed=seed, policy=FAULT_FREE_POLICY, schedule=[])
        }
        for policy in args.policies:
            runs[str(seed)][policy] = train_run(
                setup, data, xy, seed=seed, policy=policy, schedule=schedule
            )
        print(
            f"seed {seed}: "
            + ", ".join(f"{n} {r['final_eval_loss']:.4f}" for n, r in runs[str(seed)].items()),
            flush=True,
        )
    return {
        "config": _config(args, setup, names),
        "schedules": schedules,
        "runs": runs,
        "summary": summarize(runs, names),
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    result: dict[str, Any] = {
        "benchmark": "quality",
        "command": shlex.join(
            ["python", "-m", "fthsdp.bench.quality", *(sys.argv[1:] if argv is None else argv)]
        ),
        "machine": _machine(),
    }
    result.update(run_all(args))
    result["wall_s"] = time.perf_counter() - started
    # JSON first: the numbers survive even if plotting fails.
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    write_plot(result, args.plot)
    print()
    print(render(result))
    print(f"JSON: {args.json}\nPNG: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
