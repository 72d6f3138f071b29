"""The fail-slow predictor on real demo steps: its error, and its verdicts through length swings.

    python -m bench.predictor --json bench-predictor.json

Runs one `fthsdp demo --seq-len-mix phases --no-kills` (health on; by default 3 replicas x 1
rank, so that the 2-core machine's contention does not drown the workload's effect; no durable
checkpoints, whose writes are no workload) and reads
the health service's step telemetry (`GET /v1/records/steps`) while it runs. Documents are short
(8-32 tokens) and long (256-512) in phases of 20 steps, all packed into 512-token samples, so
the step time swings with Σ l² while the tokens stay constant. After `--benign-s` seconds of
training, one replica (`--slow-replica`) is throttled for `--throttle-s`: its processes are
stopped for a third of every 60 ms (SIGSTOP/SIGCONT), a real 1.5x slowdown.

Reported, using the health service's own code (`detectors.failslow`):

- the predictor's MAPE (mean |measured / predicted - 1|, percent) per replica and overall, on
  the replica steps before the throttle: fitted on each replica's first `--warmup` steps (the
  detector's warm-up) and judged on the rest, and, for reference, fitted and judged on all of
  them (the noise floor of the fit); beside it the MAPE of a predictor without the Σ l² term
  (the step-time mean), the baseline in the same run;
- the measured / predicted ratio of the throttled replica while throttled (about 1.5 expected);
- fail-slow verdicts: the live service's incidents (from the demo's report) before the
  throttle (false alarms) and during it (naming the throttled replica: caught), and the same
  telemetry replayed through the detector with the predictor and without it (a plain change
  point on step time: the benign swings are its false alarms).

A replica step is as the detector sees it: per rank, the step's duration minus its wait on the
cross-replica exchange; the maximum over the replica's ranks (N and Σ l² too). ResiHP reports
1.19-1.58 % MAPE per micro-batch on GPUs; a CPU process sharing 2 cores with the rest of the job
is much noisier. Not a pass/fail test: the numbers move with the machine's load."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx

from fthsdp.bench.predictor_score import (
    Sample,
    ape,
    mape,
    online_errors,
    score,
)
from fthsdp.services.health.detectors.config import DetectorConfig
from fthsdp.services.health.detectors.failslow import fit

SLOW_FACTOR = 1.5
"""How much slower the throttled replica runs: stopped (1 - 1/SLOW_FACTOR) of every period."""
THROTTLE_PERIOD_S = 0.06
_DASHBOARD = re.compile(r"health dashboard: (\S+)/dashboard")


# ---------------------------------------------------------------------------------------------
# The model alone


def time_micro_batches(
    mix: str, count: int, micro_batch: int = 4
) -> tuple[list[Sample], list[Sample]]:
    """(N, Σ l², seconds) of `count` training micro-batches of the demo's model on one thread in
    this process (forward, backward, AdamW step), in wall time and in the thread's CPU time: the
    predictor's error on the workload itself, without the demo's processes, exchanges and
    services, as ResiHP measures it per micro-batch. CPU time is immune to whatever else runs
    on the machine (wall time on a shared 2-core machine is not). Phases change every 20
    micro-batches here as in the demo."""
    import torch

    from fthsdp.deploy.demo.corpus import demo_dataset
    from fthsdp.deploy.demo.model import TinyGPTConfig, build_model

    torch.set_num_threads(1)
    dataset = demo_dataset(mix, samples_per_round=micro_batch)
    model = build_model(
        TinyGPTConfig(
            vocab_size=dataset.vocab_size,
            block_size=dataset.block_size,
            doc_token=dataset.doc_token,
        ),
        seed=0,
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    wall, cpu = [], []
    for step in range(count):
        ids = range(step * micro_batch, (step + 1) * micro_batch)
        began, began_cpu = time.perf_counter(), time.thread_time()
        batch = torch.stack([dataset.sample(i) for i in ids])
        _, loss = model(batch[:, :-1], batch[:, 1:])
        assert loss is not None
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        ended, ended_cpu = time.perf_counter(), time.thread_time()
        tokens, sum_sq = dataset.work(ids)
        wall.append((tokens, sum_sq, ended - began))
        cpu.append((tokens, sum_sq, ended_cpu - began_cpu))
    return wall, cpu


def score_micro_batches(samples: Sequence[Sample], warmup: int, skip: int) -> dict[str, Any]:
    """MAPE of the predictor fitted on micro-batches [skip, skip + warmup), and online."""
    fitted = fit(list(samples[skip : skip + warmup]))
    judged = list(samples[skip + warmup :])
    online = online_errors(samples, warmup, skip)
    mean_only = (0.0, 0.0, statistics.fmean(t for _, _, t in samples[skip : skip + warmup]))
    return {
        "micro_batches": len(judged),
        "alpha": fitted[0],
        "beta": fitted[1],
        "gamma": fitted[2],
        "mape_pct": mape(fitted, judged),
        "median_ape_pct": statistics.median(ape(fitted, judged)),
        "mape_online_pct": statistics.fmean(online),
        "mape_no_sq_term_pct": mape(mean_only, judged),
        "own_s_range": [min(s[2] for s in judged), max(s[2] for s in judged)],
    }


# ---------------------------------------------------------------------------------------------
# Running the demo


class Poller:
    """Reads the health service's newest step records every `period_s` while the demo runs
    (the service keeps the newest 1,000 per request), keeping each one once."""

    def __init__(self, run_dir: Path, period_s: float = 1.5) -> None:
        self.url: str | None = None
        self.records: dict[tuple[str, int, int, float], dict[str, Any]] = {}
        self._run_dir = run_dir
        self._period = period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="records", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def first_started(self) -> float | None:
        """When the earliest recorded step started."""
        return min((float(r["started_at"]) for r in self.records.values()), default=None)

    def _run(self) -> None:
        client: httpx.Client | None = None
        while not self._stop.wait(self._period):
            if client is None:
                token = self._run_dir / "token"
                if self.url is None or not token.exists():
                    continue
                client = httpx.Client(
                    base_url=self.url,
                    headers={"authorization": f"Bearer {token.read_text().strip()}"},
                    timeout=5.0,
                )
            try:
                body = client.get("/v1/records/steps", params={"limit": 1000}).json()
            except (httpx.HTTPError, ValueError):
                continue  # the service is starting or gone; the next round tries again
            for r in body.get("records", []):
                key = (r["rank"]["replica_id"], r["rank"]["rank"], r["step"], r["started_at"])
                self.records[key] = r
        if client is not None:
            client.close()


def replica_pids(run_dir: Path, replica: str) -> list[int]:
    """The rank processes of `replica` in this bench's demo (its command line names the run
    directory and the replica): processes this bench started, through the demo."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if (
            b"fthsdp.deploy.demo.train" in argv
            and str(run_dir).encode() in argv
            and replica.encode() in argv
            and argv[argv.index(b"--replica-id") + 1 : argv.index(b"--replica-id") + 2]
            == [replica.encode()]
        ):
            pids.append(int(entry.name))
    return pids


def throttle(run_dir: Path, replica: str, seconds: float, stop: threading.Event) -> None:
    """Stops `replica`'s rank processes for (1 - 1/SLOW_FACTOR) of every THROTTLE_PERIOD_S for
    `seconds`; always leaves them running."""
    stopped = THROTTLE_PERIOD_S * (1.0 - 1.0 / SLOW_FACTOR)
    until = time.monotonic() + seconds
    pids: list[int] = []
    try:
        while time.monotonic() < until and not stop.is_set():
            pids = replica_pids(run_dir, replica)
            _signal(pids, signal.SIGSTOP)
            time.sleep(stopped)
            _signal(pids, signal.SIGCONT)
            time.sleep(THROTTLE_PERIOD_S - stopped)
    finally:
        _signal(pids, signal.SIGCONT)


def _signal(pids: Sequence[int], sig: signal.Signals) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def run_demo(args: argparse.Namespace, run_dir: Path) -> dict[str, Any]:
    """Runs the demo, throttles the slow replica mid-run, and returns the recorded telemetry,
    the report's incidents and the throttle's window."""
    duration = args.benign_s + args.throttle_s + args.tail_s
    command = [
        sys.executable, "-m", "fthsdp.deploy.cli", "demo",
        "--seq-len-mix", args.seq_len_mix,
        "--replicas", str(args.replicas), "--ranks", str(args.ranks),
        "--duration", f"{duration:g}", "--no-kills", "--no-live", "--progress-every", "10",
        "--durable-every-steps", "0",
        "--seed", str(args.seed), "--run-dir", str(run_dir),
    ]  # fmt: skip
    poller = Poller(run_dir)
    poller.start()
    window: tuple[float, float] | None = None
    stop = threading.Event()
    worker: threading.Thread | None = None
    with subprocess.Popen(command, stdout=subprocess.PIPE, text=True) as demo:
        assert demo.stdout is not None

        def read() -> None:
            assert demo.stdout is not None
            for line in demo.stdout:
                print(f"  demo: {line.rstrip()}", flush=True)
                found = _DASHBOARD.search(line)
                if found:
                    poller.url = found.group(1)

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        try:
            while demo.poll() is None:
                first = poller.first_started()
                if (
                    worker is None
                    and args.throttle_s > 0
                    and first is not None
                    and time.time() >= first + args.benign_s
                ):
                    begin = time.time()
                    window = (begin, begin + args.throttle_s)
                    worker = threading.Thread(
                        target=throttle,
                        args=(run_dir, args.slow_replica, args.throttle_s, stop),
                        daemon=True,
                    )
                    worker.start()
                    print(f"throttling {args.slow_replica} {SLOW_FACTOR}x", flush=True)
                time.sleep(0.2)
        finally:
            stop.set()
            if worker is not None:
                worker.join()
            if demo.poll() is None:
                demo.terminate()
            reader.join(timeout=10)
    poller.stop()
    report_path = run_dir / "report.json"
    report = json.loads(report_path.read_text()) if report_path.exists() else {}
    return {
        "records": list(poller.records.values()),
        "incidents": report.get("incidents", []),
        "throttle": window,
        "returncode": demo.returncode,
    }


def print_table(result: Mapping[str, Any], args: argparse.Namespace) -> None:
    print(
        f"\n{'replica':<8} {'judged':>6} {'online':>7} {'median':>7} {'MAPE':>7} {'median':>7} "
        f"{'no Σl² term':>11} {'first-steps fit':>15} {'in-sample':>9} {'beta s/Σl²':>11} "
        f"{'own s range':>12}"
    )
    for replica, row in result["replicas"].items():
        print(
            f"{replica:<8} {row['judged']:>6} {row['mape_online_pct']:>6.1f}% "
            f"{row['median_ape_online_pct']:>6.1f}% {row['mape_pct']:>6.1f}% "
            f"{row['median_ape_pct']:>6.1f}% {row['mape_no_sq_term_pct']:>10.1f}% "
            f"{row['mape_first_steps_fit_pct']:>14.1f}% {row['mape_in_sample_pct']:>8.1f}% "
            f"{row['beta']:>11.2e} {row['own_s_range'][0]:.3f}-{row['own_s_range'][1]:.3f}"
        )
    overall = result["overall"]
    if overall["mape_pct"] is not None:
        print(
            f"overall, {overall['steps_judged']} replica steps: MAPE online (refitted as the "
            f"detector does) {overall['mape_online_pct']:.1f}% (median APE "
            f"{overall['median_ape_online_pct']:.1f}%); fitted once on steps "
            f"{args.skip_steps}..{args.skip_steps + args.warmup - 1} of each replica "
            f"{overall['mape_pct']:.1f}% ({overall['median_ape_pct']:.1f}%); ResiHP: "
            "1.19-1.58% per micro-batch"
        )
    slowed = result["throttled"]
    if slowed is not None and slowed["median_ratio"] is not None:
        print(
            f"{args.slow_replica} throttled {SLOW_FACTOR}x: measured / predicted "
            f"{slowed['median_ratio']:.2f} (median of {slowed['steps']} steps; the others "
            f"{slowed['peers_median_ratio']:.2f})"
        )
    for key, what in (("model_alone", "wall"), ("model_alone_cpu_time", "CPU")):
        alone = result.get(key)
        if alone is None:
            continue
        print(
            f"the model alone, {alone['micro_batches']} micro-batches in this process, {what} "
            f"time: MAPE {alone['mape_pct']:.2f}% (median APE {alone['median_ape_pct']:.2f}%, "
            f"online {alone['mape_online_pct']:.2f}%); without the Σl² term "
            f"{alone['mape_no_sq_term_pct']:.1f}%; "
            f"{alone['own_s_range'][0] * 1e3:.0f}-{alone['own_s_range'][1] * 1e3:.0f} ms"
        )
    v = result["verdicts"]
    print(
        f"fail-slow verdicts, live service: {len(v['live_false_alarms'])} false alarms, "
        f"{len(v['live_caught'])} naming {args.slow_replica} while throttled"
    )
    print(
        f"replayed before the throttle: predictor {len(v['replay_predictor_before'])}, plain "
        f"change point {len(v['replay_plain_before'])} verdicts (all false alarms); whole run "
        f"with the predictor: {[(i['replica_id'], i['step']) for i in v['replay_predictor_all']]}"
    )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.predictor", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--replicas", type=int, default=3, help="replicas (default 3)")
    p.add_argument("--ranks", type=int, default=1, help="ranks per replica (default 1)")
    p.add_argument(
        "--seq-len-mix", choices=("phases", "random"), default="phases",
        help="the demo's document lengths (default phases)",
    )  # fmt: skip
    p.add_argument(
        "--benign-s", type=float, default=45.0,
        help="seconds of training before the throttle (default 45)",
    )  # fmt: skip
    p.add_argument(
        "--throttle-s", type=float, default=15.0,
        help="seconds the slow replica is throttled 1.5x (default 15; 0: none)",
    )  # fmt: skip
    p.add_argument(
        "--tail-s", type=float, default=10.0,
        help="seconds of training after the throttle (default 10)",
    )  # fmt: skip
    p.add_argument("--slow-replica", default="r1", help="the replica to throttle (default r1)")
    p.add_argument(
        "--warmup", type=int, default=DetectorConfig().fail_slow_warmup_steps,
        help="steps the predictor is fitted on (default: the detector's warm-up)",
    )  # fmt: skip
    p.add_argument(
        "--skip-steps", type=int, default=40,
        help="steps of each replica left out before the fit: the start-up's are slow (default 40)",
    )  # fmt: skip
    p.add_argument(
        "--model-micro-batches", type=int, default=300,
        help="micro-batches timed in this process, the model alone (default 300; 0: none)",
    )  # fmt: skip
    p.add_argument("--seed", type=int, default=0, help="the demo's seed (default 0)")
    p.add_argument("--run-dir", type=Path, help="the demo's run directory (default: temporary)")
    p.add_argument("--json", type=Path, help="write the figures and the telemetry here")
    p.add_argument(
        "--rescore", type=Path,
        help="run no demo: score the telemetry of an earlier run's --json file",
    )  # fmt: skip
    args = p.parse_args(argv)
    if args.replicas < 3 or args.ranks < 1:
        p.error("--replicas >= 3 (a slow replica needs peers and a quorum without it)")
    if args.benign_s <= 0 or args.throttle_s < 0 or args.tail_s < 0:
        p.error("--benign-s > 0, --throttle-s and --tail-s >= 0")
    if args.warmup < 4 or args.skip_steps < 0:
        p.error("--warmup >= 4, --skip-steps >= 0")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    began = time.monotonic()
    run_dir = args.run_dir
    if args.rescore is not None:
        earlier = json.loads(args.rescore.read_text())
        ran = {
            "records": earlier["records"],
            "incidents": earlier.get("incidents", []),
            "throttle": None if earlier["throttle"] is None else tuple(earlier["throttle"]),
            "returncode": earlier.get("demo_returncode"),
        }
    else:
        run_dir = run_dir or Path(tempfile.mkdtemp(prefix="fthsdp-bench-predictor-"))
        ran = run_demo(args, run_dir)
    if not ran["records"]:
        print("no step telemetry was recorded", file=sys.stderr)
        return 1
    result = score(
        ran["records"],
        ran["incidents"],
        throttle=ran["throttle"],
        slow_replica=args.slow_replica,
        warmup=args.warmup,
        skip=args.skip_steps,
    )
    if args.model_micro_batches > 0:
        wall, cpu = time_micro_batches(args.seq_len_mix, args.model_micro_batches)
        result["model_alone"] = score_micro_batches(wall, args.warmup, skip=20)
        result["model_alone_cpu_time"] = score_micro_batches(cpu, args.warmup, skip=20)
    print_table(result, args)
    print(f"({time.monotonic() - began:.0f} s, run dir {run_dir})")
    if args.json:
        from fthsdp.bench.recovery import machine

        document = {
            "benchmark": "predictor",
            **result,
            "throttle": ran["throttle"],
            "demo_returncode": ran["returncode"],
            "incidents": ran["incidents"],
            "args": vars(args),
            "machine": machine(),
            "records": ran["records"],
        }
        args.json.write_text(json.dumps(document, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
