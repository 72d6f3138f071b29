"""The table `bench.scale` prints from its result document (`scale.py` measures)."""

from __future__ import annotations

from typing import Any

W = 46
"""Width of the label column."""

TARGETS: dict[str, dict[str, float]] = {
    "12x8192": {"ring_s": 0.7, "round_p99_ms": 20.0},
    "1536x64": {"round_p99_ms": 50.0},
}
"""The issue's targets per shape; RSS and RCA targets hold at any ~100K shape."""
RSS_TARGET_BYTES = 2**30
RCA_TARGET_S = 1.0


def _f(value: Any, fmt: str = ".3f", scale: float = 1.0) -> str:
    if value is None:
        return "—"
    return format(value * scale, fmt)


def _mb(value: Any) -> str:
    """Bytes in B, kB or MB (decimal), whichever reads best."""
    if value is None:
        return "—"
    if value < 1e3:
        return f"{value:.0f} B"
    if value < 1e6:
        return f"{value / 1e3:.1f} kB"
    return f"{value / 1e6:,.1f} MB"


def render(result: dict[str, Any]) -> str:
    s, m = result["shape"], result["machine"]
    label = f"{s['replicas']}x{s['ranks']}"
    lines = [
        f"fthsdp control plane at scale: {s['replicas']:,} replicas × {s['ranks']:,} ranks = "
        f"{s['total_ranks']:,} ranks on {s['hosts']:,} hosts of {s['ranks_per_host']}; "
        f"{result['settings']['clients']} client processes",
        f"machine: {m['nproc']} cpus, load avg {m['load_avg_start']} at start, "
        f"{m.get('load_avg_end')} at end; wall {_f(result.get('wall_s'), '.0f')} s",
    ]
    cap = result.get("world_size_cap")
    if cap:
        how = (
            "lifted in the service process only"
            if cap["lifted_in_the_service_process"]
            else ("Join is refused")
        )
        lines.append(f"world size {s['ranks']} is over the service's cap of {cap['cap']}: {how}")
    targets = TARGETS.get(label, {})
    for section in (_setup, _rounds, _failures, _ingest, _rca, _processes):
        lines += section(result, targets)
    if result["incomplete"]:
        lines += ["", "did not complete / fell short:"] + [f"  {x}" for x in result["incomplete"]]
    return "\n".join(lines)


def _setup(result: dict[str, Any], targets: dict[str, float]) -> list[str]:
    st = result.get("setup")
    if not st:
        return []
    joined = f"{st['joined']:,} / {result['shape']['replicas']:,}"
    live = f"{st['streams_live']:,} / {st['streams_total']:,}"
    agents = f"{st.get('agent_streams_live', 0):,} / {st.get('agent_streams_total', 0):,}"
    if st.get("agent_stream_failures"):
        agents += f" ({st['agent_stream_failures']:,} retried)"
    reasons = [
        f"    {n:,} x {why}"
        for why, n in list(st.get("agent_stream_failure_reasons", {}).items())[:3]
    ]
    return [
        "",
        f"{'setup':<{W}}{'done':>22}{'s':>9}",
        f"{'  leaders joined':<{W}}{joined:>22}{_f(st['join_s'], '.1f'):>9}",
        f"{'  leader Watch streams live (snapshot received)':<{W}}{live:>22}"
        f"{_f(st['setup_s'], '.1f'):>9}",
        f"{'  node agent Watch streams live':<{W}}{agents:>22}",
        *reasons,
        f"  quorum service RSS with every stream open: {_mb(st.get('quorum_rss_bytes'))}",
    ]


def _rounds(result: dict[str, Any], targets: dict[str, float]) -> list[str]:
    r = result.get("rounds")
    if not r:
        return []
    target = targets.get("round_p99_ms")
    goal = "" if target is None else f"≤ {target:g} ms"
    first = r["first"]
    per = r["bytes_per_response"]
    title = f"quorum rounds: {r['leaders']} leaders, {r['rounds']} steady"
    return [
        "",
        f"{title:<{W}}{'p50 ms':>10}{'p99 ms':>10}   target p99",
        f"{'  server (last ask → every answer sent)':<{W}}{_f(r['server_p50_ms'], '.2f'):>10}"
        f"{_f(r['server_p99_ms'], '.2f'):>10}   {goal}",
        f"{'  client (last request → last answer)':<{W}}{_f(r['client_p50_ms'], '.2f'):>10}"
        f"{_f(r['client_p99_ms'], '.2f'):>10}",
        f"{'  service CPU per steady round':<{W}}{_f(r['service_cpu_ms_per_round'], '.2f'):>10} ms",
        f"{'  answers per steady round (on the wire)':<{W}}{_mb(r['bytes_per_round']):>10}"
        f"   ({_f(per, ',.0f')} B per leader)",
        f"{'  first round (neighbourhoods)':<{W}}{_f(first['client_s'], '.3f'):>10} s"
        f"   {_mb(first['bytes'])} to {first['responses']:,} leaders",
    ]


STAGE_LABELS = {
    "evicted": "service evicts the replica",
    "ranks notified": "every surviving rank aborted its exchange",
    "replicas voted": "every surviving replica voted no",
    "leaders left it out": "every survivor has a quorum without it",
    "leaders hold quorum": "every survivor holds the full new quorum",
    "ranks hold ring": "every surviving rank holds its new ring",
    "its agents heard it": "every node agent of its replica heard it",
}


def _failures(result: dict[str, Any], targets: dict[str, float]) -> list[str]:
    failures = result.get("failures") or []
    if not failures:
        return []
    col = 28
    head = "".join(
        f"{'#' + str(n) + ' ' + f['victim']['replica_id'] + ':' + str(f['victim']['rank']):>{col}}"
        for n, f in enumerate(failures, start=1)
    )
    lines = ["", f"{'per failure: s after the rank died':<{W}}{head}   target"]
    row = f"{'  agent found it dead (report sent)':<{W}}"
    lines.append(row + "".join(f"{_f(f['detected_s']):>{col}}" for f in failures))
    for k, name in enumerate(STAGE_LABELS):
        cells = "".join(f"{_stage_cell(f['stages'][k]):>{col}}" for f in failures)
        goal = (
            f"   ≤ {targets['ring_s']:g}"
            if name == "ranks hold ring" and "ring_s" in targets
            else ""
        )
        lines.append(f"{'  ' + STAGE_LABELS[name]:<{W}}{cells}{goal}")
    messages = "".join(f"{f.get('agent_messages', 0):>{col},}" for f in failures)
    mode = result.get("settings", {}).get("agent_streams", "filtered")
    lines.append(f"{'  events to agent streams (' + mode + ')':<{W}}{messages}")
    extra = "".join(
        f"{str(f['via_exchange_timeout']) + ' / ' + str(f['wrong_neighbours']):>{col}}"
        for f in failures
    )
    lines.append(f"{'  ranks via exchange timeout / wrong ring':<{W}}{extra}")
    ring = "".join(
        f"{(','.join(map(str, f['ring_sizes'])) or '—') + ' / ' + str(f['epochs']):>{col}}"
        for f in failures
    )
    lines.append(f"{'  new ring size / quorums to reach it':<{W}}{ring}")
    cpu = "".join(f"{_f(f['cpu_s'].get('quorum'), '.1f'):>{col}}" for f in failures)
    lines.append(f"{'  quorum service CPU s in the phase':<{W}}{cpu}")
    rounds = "".join(f"{_service_rounds(f.get('service_rounds') or []):>{col}}" for f in failures)
    lines.append(f"{'  its rounds: members @ s to answer them all':<{W}}{rounds}")
    work = _plan_work(result)
    if work:
        lines.append(f"  plan work per leader/rank, once per process: {work}")
    relay = result.get("relay")
    if relay:
        lines.append(
            f"  ranks hear events through the relay tree: {relay['fanout']} children a rank, "
            f"one hop {relay['hop_s_p50'] * 1e3:.2f} ms p50 / {relay['hop_s_p99'] * 1e3:.2f} ms "
            f"p99 (real code, loopback), p99 used: depth {relay['depth']} -> "
            f"{relay['depth'] * relay['hop_s_p99'] * 1e3:.1f} ms after the leader"
        )
    lines.append("  the in-replica broadcast of the plan is not emulated (it needs torch)")
    return lines


def _service_rounds(rounds: list[Any]) -> str:
    """The rounds the service formed during a failure, e.g. `11@3.21` (a few at most)."""
    if not rounds:
        return "—"
    shown = " ".join(f"{n}@{s:.2f}" for n, s in rounds[:3])
    return shown + (f" +{len(rounds) - 3}" if len(rounds) > 3 else "")


def _stage_cell(st: dict[str, Any]) -> str:
    if st["total"] == 0:
        return "—"  # nobody to reach it (no agent streams)
    if st["complete"]:
        return f"{st['seconds']:.3f}"
    return f"{st['done']:,}/{st['total']:,} @{st['deadline_s']:g}s"


def _plan_work(result: dict[str, Any]) -> str:
    """Median / max CPU ms of the plan work over the client processes."""
    parts = []
    keys = (("encode_ms", "encode"), ("steady_check_ms", "steady check"), ("decode_ms", "decode"))
    for key, name in keys:
        cells = [
            c["plan_work"][key]
            for c in result.get("clients", {}).values()
            if isinstance(c, dict) and "plan_work" in c and c["plan_work"][key]["n"]
        ]
        if cells:
            median = max(cell["median"] for cell in cells)
            longest = max(cell["max"] for cell in cells)
            parts.append(f"{name} {median:.0f}/{longest:.0f}")
    return ", ".join(parts) + " ms CPU (median/max)" if parts else ""


def _ingest(result: dict[str, Any], targets: dict[str, float]) -> list[str]:
    g = result.get("ingest")
    if not g:
        return []
    share = g["central_cpu_share"]
    fwd_share = (
        None if not g["forwards_per_s"] else g["forwards_per_s"] / g["needed_forwards_per_s"]
    )
    per_agent = g["needed_forwards_per_s"] / g["agents"] if g["agents"] else 0.0
    title = (
        f"health ingest: {g['agents']:,} agents, {g['ranks']:,} ranks, {_f(g['window_s'], '.1f')} s"
    )
    asked = g.get("asked_interval_s") or 0.0
    spacing = (
        f"  central asked every agent to forward every {asked:.1f} s (it takes "
        f"{g['central_takes_per_s']:g} forwards a second); measured after "
        f"{_f(g.get('settle_s'), '.1f')} s to settle"
        if asked
        else "  central asked no agent to forward less often: each at its own interval"
    )
    return [
        "",
        f"{title:<{W}}{'needed/s':>12}{'acked/s':>12}{'share':>8}",
        spacing,
        f"{'  rank beats to their agents (ranks × 5/s)':<{W}}{g['needed_beats_per_s']:>12,.0f}"
        f"{'local':>12}",
        f"{f'  agent forwards to central (agents × {per_agent:g}/s)':<{W}}"
        f"{g['needed_forwards_per_s']:>12,.0f}"
        f"{_f(g['forwards_per_s'], ',.0f'):>12}{_f(fwd_share, '.1%'):>8}",
        f"{'  rank entries in them':<{W}}{g['needed_rank_entries_per_s']:>12,.0f}"
        f"{_f(g['rank_entries_per_s'], ',.0f'):>12}",
        f"  central: {_f(share, '.0%')} of a core ({_f(g.get('central_idle_share'), '.0%')} "
        f"when idle), {g['central_served']:,} forwards served, "
        f"{_f(g['central_us_per_forward'], ',.0f')} µs each → ≈ "
        f"{_f(g['central_capacity_forwards_per_s'], ',.0f')} forwards/s per core",
        f"  agents: CPU {_f(g['clients_cpu_s'], '.1f')} s in all; latency p50/p99 "
        f"{_f(g['latency_p50_s'], '.0f', 1000)}/{_f(g['latency_p99_s'], '.0f', 1000)} ms; "
        f"failed {g['failed']:,}",
    ]


def _rca(result: dict[str, Any], targets: dict[str, float]) -> list[str]:
    r = result.get("rca")
    if not r:
        return []
    c = r["culprit"]
    named = (
        f"named in an evaluate of {_f(r['rca_s'], '.3f')} s (target ≤ {RCA_TARGET_S:g} s), "
        f"{_f(r['named_after_ingest_s'], '.1f')} s after the last batch (hang timeout "
        f"{r['hang_timeout_s']:g} s, raised while the records went in)"
        if r["named"]
        else f"NOT named within {r['deadline_s']:g} s"
    )
    return [
        "",
        f"RCA of a hang at {result['shape']['total_ranks']:,} ranks over the wire",
        f"  {r['records']:,} records in {r['batches']:,} batches ({r['failed_batches']} failed): "
        f"produced {r['generate_s']:.1f} s, encoded {r['encode_s']:.1f} s, ingested "
        f"{r['ingest_s']:.1f} s ({_f(r['ingest_records_per_s'], ',.0f')} records/s)",
        f"  culprit {c['replica_id']}:{c['rank']} {named}; incidents {r['incidents']}; "
        f"evaluations > 50 ms: {r['slow_evaluations']} "
        f"(slowest {_f(r['slowest_evaluation_s'], '.3f')} s)",
    ]


def _processes(result: dict[str, Any], targets: dict[str, float]) -> list[str]:
    procs = result.get("processes") or {}
    phases = ["setup", "first_round", "rounds"]
    phases += [f"failure-{n}" for n in range(1, len(result.get("failures") or []) + 1)]
    phases += ["ingest", "rca"]
    head = "".join(f"{p:>12}" for p in phases)
    lines = ["", f"{'CPU s per phase':<16}{head}{'RSS peak':>12}"]
    for name, p in procs.items():
        cells = "".join(f"{_f(p['cpu_s'].get(ph), '.1f'):>12}" for ph in phases)
        lines.append(f"{'  ' + name:<16}{cells}{_mb(p['rss_peak_bytes']):>12}")
    lines.append("garbage collection s (part of the CPU above)")
    for name, p in procs.items():
        if p.get("gc_s"):
            cells = "".join(f"{_f(p['gc_s'].get(ph), '.1f'):>12}" for ph in phases)
            lines.append(f"{'  ' + name:<16}{cells}")
    rss = procs.get("quorum", {}).get("rss_peak_bytes")
    if rss is not None:
        verdict = "meets" if rss <= RSS_TARGET_BYTES else "misses"
        lines.append(f"  quorum service RSS peak {_mb(rss)} {verdict} the ≤ 1 GB target")
    return lines
