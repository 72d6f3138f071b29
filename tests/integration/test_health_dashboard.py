"""The dashboard in a real headless Chromium (the system's /usr/bin/chromium, driven by
playwright; no browser is ever downloaded): it shows the replicas and an incident injected
through the ingest API, updates live when the state changes after load, and without a token
says so instead of showing data. Its charts (the vendored uPlot) get one series per replica from
the step records and mark incidents; the quorum history collapses to membership changes, and the
replicas table says which replicas the quorum holds; incident evidence reads as rounded fields
with units, the raw JSON behind a closed disclosure that stays as the operator leaves it.

Every test saves a full-page screenshot under its tmp_path (`screenshots/`) and, when
$FTHSDP_ARTIFACTS names a folder, a copy under `<it>/health-dashboard/`."""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from fthsdp.protos import health_pb2 as pb
from fthsdp.services.health.detectors.config import DetectorConfig
from fthsdp.services.quorum.client import AsyncQuorumClient, RankEndpoint
from tests.integration.conftest import QuorumServerFactory
from tests.integration.health_support import health_nodes, heartbeat, incident, rank_ref, report

CHROMIUM = "/usr/bin/chromium"
ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
RANK = RankEndpoint(ftar="127.0.0.1:29500", checkpoint="http://127.0.0.1:8080")
WAIT_MS = 10_000


@pytest.fixture
async def browser(tmp_path: Path) -> AsyncIterator[Any]:
    if not os.path.exists(CHROMIUM):
        if os.environ.get("CI"):
            pytest.fail("chromium is missing: scripts/bootstrap.sh test should have installed it")
        pytest.skip("chromium is not installed (run scripts/bootstrap.sh test)")
    playwright_api = pytest.importorskip("playwright.async_api")
    profile = tmp_path / "profile"
    async with playwright_api.async_playwright() as pw:
        context = await pw.chromium.launch_persistent_context(
            str(profile), executable_path=CHROMIUM, headless=True, args=ARGS
        )
        try:
            yield context
        finally:
            await context.close()
    shutil.rmtree(profile, ignore_errors=True)


async def test_dashboard_shows_replicas_and_incidents_and_updates_live(
    browser: Any, token: str
) -> None:
    async with health_nodes(token) as make:
        central = await make()
        await report(
            central.grpc_address,
            token,
            pb.ReportRequest(
                host="node-a",
                heartbeats=[heartbeat("r0", step=3), heartbeat("r1", step=3)],
                incidents=[incident("sdc", "r1", "replica r1 digest differs", step=3)],
            ),
        )
        page = await browser.new_page()
        await page.goto(f"{central.http_url}/dashboard#token={token}")
        r0 = page.locator('#replicas tr[data-replica="r0"]')
        await r0.wait_for(timeout=10_000)
        assert await r0.locator(".step").inner_text() == "3"
        assert await page.locator('#replicas tr[data-replica="r1"]').count() == 1
        sdc = page.locator('#incidents li[data-kind="sdc"]')
        await sdc.wait_for(timeout=10_000)
        assert "replica r1 digest differs" in await sdc.inner_text()
        assert await sdc.locator('.field[data-key="step"] dd').inner_text() == "3"
        assert '"step": 3' in (await sdc.locator("details.raw pre").text_content() or "")
        assert await page.locator('#incidents li[data-kind="hang"]').count() == 0

        # A change after load: a new replica, a new step and a new incident must appear
        # without reloading the page.
        await report(
            central.grpc_address,
            token,
            pb.ReportRequest(
                host="node-a",
                heartbeats=[heartbeat("r0", step=9), heartbeat("r2", step=9)],
                incidents=[incident("hang", "r2", "rank 0 of r2 blocks allreduce 17")],
            ),
        )
        hang = page.locator('#incidents li[data-kind="hang"]')
        await hang.wait_for(timeout=10_000)
        assert "blocks allreduce 17" in await hang.inner_text()
        await page.locator('#replicas tr[data-replica="r2"]').wait_for(timeout=10_000)
        await page.wait_for_function(
            # A function, not an expression: playwright evals a polled expression, which the
            # page's CSP (no 'unsafe-eval') refuses.
            "() => document.querySelector('#replicas tr[data-replica=r0] .step')"
            ".textContent === '9'",
            timeout=10_000,
        )
        assert "error" not in (await page.locator("#status").get_attribute("class") or "")

        # Without the token in the fragment the page shows no data, and says why.
        anonymous = await browser.new_page()
        await anonymous.goto(f"{central.http_url}/dashboard")
        status = anonymous.locator("#status.error")
        await status.wait_for(timeout=10_000)
        assert "no token" in await status.inner_text()
        assert await anonymous.locator("#replicas tr").count() == 1  # the header row only


async def _open(browser: Any, origin: str, token: str) -> tuple[Any, list[str]]:
    """The dashboard, wide enough for both charts side by side, and what went wrong on it: a
    script error, anything logged as an error (what the CSP refused among it), and any request
    that left the service (the page must need nothing from elsewhere, no CDN)."""
    page = await browser.new_page()
    await page.set_viewport_size({"width": 1400, "height": 1000})
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(f"pageerror: {exc}"))
    page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)

    def check_request(request: Any) -> None:
        if not request.url.startswith((origin + "/", "data:")):
            errors.append(f"request off the service: {request.url}")

    page.on("request", check_request)
    await page.goto(f"{origin}/dashboard#token={token}")
    return page, errors


async def _screenshot(page: Any, tmp_path: Path, name: str) -> Path:
    path = tmp_path / "screenshots" / f"{name}.png"
    path.parent.mkdir(exist_ok=True)
    await page.screenshot(path=str(path), full_page=True)
    artifacts = os.environ.get("FTHSDP_ARTIFACTS")
    if artifacts:
        folder = Path(artifacts) / "health-dashboard"
        folder.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, folder / path.name)
    return path


def _step(replica_id: str, step: int, started_at: float, duration_s: float) -> pb.StepRecord:
    return pb.StepRecord(
        rank=rank_ref(replica_id),
        step=step,
        started_at=started_at,
        duration_s=duration_s,
        tokens=1024,
        sum_seq_len_sq=4096,
        committed=True,
    )


async def test_charts_plot_one_step_time_series_per_replica_and_mark_incidents(
    browser: Any, token: str, tmp_path: Path
) -> None:
    now = time.time()
    steps = [
        _step(r, s, now - 10 + s, 0.2 if r == "r0" else 0.35)
        for r in ("r0", "r1")
        for s in range(5)
    ]
    # Older than the charts' 10-minute window: the page must not plot it.
    steps.append(_step("r0", 99, now - 1200, 9.0))
    async with health_nodes(token) as make:
        # No fail-stop incident of its own while the test runs: it counts the markers.
        central = await make(detectors=DetectorConfig(heartbeat_timeout_s=60.0))
        await report(
            central.grpc_address,
            token,
            pb.ReportRequest(
                host="node-a",
                heartbeats=[heartbeat("r0", step=4), heartbeat("r1", step=4)],
                steps=steps,
            ),
        )
        page, errors = await _open(browser, central.http_url or "", token)
        await page.wait_for_function(
            "() => { const c = window.fthsdpDashboard && window.fthsdpDashboard.charts.steps;"
            " return c && c.series.length === 3 && c.data[0].length === 5; }",
            timeout=WAIT_MS,
        )
        chart = await page.evaluate(
            "() => { const c = window.fthsdpDashboard.charts.steps;"
            " return {labels: c.series.slice(1).map((s) => s.label),"
            " points: c.data.slice(1).map((ys) => ys.filter((y) => y !== null)),"
            " oldest: Math.min(...c.data[0]), now: window.fthsdpDashboard.now}; }"
        )
        assert await page.evaluate("typeof uPlot") == "function"  # the vendored copy
        assert chart["labels"] == ["r0", "r1"]
        assert [sorted(set(p)) for p in chart["points"]] == [[0.2], [0.35]]
        assert chart["oldest"] >= chart["now"] - 600
        assert await page.locator("#step-chart canvas").count() == 1
        assert await page.locator("#health-chart canvas").count() == 1
        assert await page.locator("#step-chart-empty").is_hidden()
        # No quorum service: the healthy chart has the health service's own count only.
        assert await page.evaluate("window.fthsdpDashboard.charts.health.series.length") == 2
        assert await page.evaluate("window.fthsdpDashboard.markersDrawn") == 0

        await report(
            central.grpc_address,
            token,
            pb.ReportRequest(
                host="node-a",
                heartbeats=[heartbeat("r0", step=4), heartbeat("r1", step=4)],
                incidents=[
                    incident("hang", "r1", "rank 0 of r1 blocks allreduce 3"),
                    incident("fail_slow", "r0", "r0 is slow"),
                ],
            ),
        )
        await page.wait_for_function(
            "() => window.fthsdpDashboard.markersDrawn === 2", timeout=WAIT_MS
        )
        await _screenshot(page, tmp_path, "charts")
        assert errors == []


async def test_quorum_history_collapses_to_membership_changes_and_the_table_agrees(
    browser: Any, token: str, tmp_path: Path, make_quorum_server: QuorumServerFactory
) -> None:
    quorum = await make_quorum_server(heartbeat_timeout=timedelta(seconds=30))
    ids = ("r0", "r1", "r2")
    clients = {r: AsyncQuorumClient(quorum.address, token) for r in ids}
    incarnations = {r: await clients[r].join(r, [RANK]) for r in ids}

    async def rounds(members: tuple[str, ...], steps: range) -> None:
        for step in steps:
            await asyncio.gather(
                *(
                    clients[r].quorum(r, incarnations[r], step, timeout=timedelta(seconds=10))
                    for r in members
                )
            )

    try:
        async with health_nodes(token) as make:
            # Its fail-stop detector must not evict the replicas that beat only once.
            central = await make(
                quorum=(quorum.address,), detectors=DetectorConfig(heartbeat_timeout_s=60.0)
            )
            await report(
                central.grpc_address,
                token,
                pb.ReportRequest(host="node-a", heartbeats=[heartbeat(r, step=1) for r in ids]),
            )
            # Three quorums of r0, r1, r2; r2 leaves; two of r0, r1. The page opens after the
            # first, so it sees them across several polls and must still show one row per
            # membership.
            await rounds(ids, range(1))
            page, errors = await _open(browser, central.http_url or "", token)
            await page.locator('#replicas tr[data-replica="r2"]').wait_for(timeout=WAIT_MS)
            await rounds(ids, range(1, 3))
            await clients["r2"].leave("r2", incarnations["r2"], "done")
            await rounds(("r0", "r1"), range(3, 5))
            await page.wait_for_function(
                "() => [...document.querySelectorAll('#quorums tbody tr')]"
                ".map((tr) => tr.dataset.members + 'x' + tr.dataset.count).join(' ')"
                " === 'r0,r1x2 r0,r1,r2x3'",
                timeout=WAIT_MS,
            )
            newest = page.locator("#quorums tbody tr").first
            assert "r0, r1" in await newest.inner_text()
            # The replicas table agrees with the latest quorum.
            await page.wait_for_function(
                "() => document.querySelector('#replicas tr[data-replica=r2]')"
                ".dataset.quorum === 'out'",
                timeout=WAIT_MS,
            )
            for replica_id in ("r0", "r1"):
                row = page.locator(f'#replicas tr[data-replica="{replica_id}"]')
                assert await row.get_attribute("data-quorum") == "in"
            assert central.engine is not None
            judgement = {v.replica_id: v.fail_slow for v in central.engine.replicas()}["r0"]
            cell = page.locator('#replicas tr[data-replica="r0"] .fail-slow')
            assert await cell.inner_text() == judgement
            # With a quorum: members and healthy from its history, plus the service's own count.
            assert await page.evaluate("window.fthsdpDashboard.charts.health.series.length") == 4
            await _screenshot(page, tmp_path, "quorum-history")
            assert errors == []
    finally:
        for client in clients.values():
            await client.close()


async def test_incident_evidence_reads_as_rounded_fields_with_the_raw_json_closed(
    browser: Any, token: str, tmp_path: Path
) -> None:
    evidence = {
        "step": 7,
        "measured_s": 0.123456,
        "ratio": 1.834567,
        "lag_ms": 12.34567,
        "noise": 0.0456789,
        "use_predictor": True,
    }
    async with health_nodes(token) as make:
        central = await make()
        await report(
            central.grpc_address,
            token,
            pb.ReportRequest(
                host="node-a",
                heartbeats=[heartbeat("r0", step=7)],
                incidents=[incident("fail_slow", "r0", "replica r0 is fail-slow", **evidence)],
            ),
        )
        page, errors = await _open(browser, central.http_url or "", token)
        item = page.locator('#incidents li[data-kind="fail_slow"]')
        await item.wait_for(timeout=WAIT_MS)

        async def field(key: str) -> str:
            text: str = await item.locator(f'.field[data-key="{key}"] dd').inner_text()
            return text

        assert await field("measured_s") == "0.123 s"
        assert await field("ratio") == "183 %"
        assert await field("lag_ms") == "12.3 ms"
        assert await field("noise") == "0.0457"
        assert await field("step") == "7"
        assert await field("use_predictor") == "yes"
        assert "0.123456" not in await item.locator(".fields").inner_text()
        raw = item.locator("details.raw")
        assert await raw.evaluate("(d) => d.open") is False
        assert not await item.locator("details.raw pre").is_visible()
        assert '"measured_s": 0.123456' in (await raw.locator("pre").text_content() or "")

        # Opened, it stays open across polls (the list keeps the nodes it already shows).
        await raw.locator("summary").click()
        polls = await page.evaluate("window.fthsdpDashboard.polls")
        await page.wait_for_function(
            f"() => window.fthsdpDashboard.polls >= {polls + 2}", timeout=WAIT_MS
        )
        assert await raw.evaluate("(d) => d.open") is True
        assert await item.locator("details.raw pre").is_visible()
        await _screenshot(page, tmp_path, "evidence")
        assert errors == []
