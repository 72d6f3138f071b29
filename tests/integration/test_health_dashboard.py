"""The dashboard in a real headless Chromium (the system's /usr/bin/chromium, driven by
playwright; no browser is ever downloaded): it shows the replicas and an incident injected
through the ingest API, updates live when the state changes after load, and without a token
says so instead of showing data."""

from __future__ import annotations

import os
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from fthsdp.protos import health_pb2 as pb
from tests.integration.health_support import health_nodes, heartbeat, incident, report

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
        assert '"step":3' in await sdc.locator(".evidence").inner_text()
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
            "document.querySelector('#replicas tr[data-replica=\"r0\"] .step').textContent === '9'",
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
