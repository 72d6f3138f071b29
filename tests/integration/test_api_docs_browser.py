"""The API pages in a real headless Chromium, with every request to another host refused: Swagger
UI renders the health service's API, Authorize plus "Try it out" gets a 200 from a guarded route,
and ReDoc renders the same description; the pages' own policy (`api_docs.PAGE_CSP`) blocks
nothing they need."""

from __future__ import annotations

from typing import Any

from tests.integration.health_support import health_nodes
from tests.integration.test_health_dashboard import WAIT_MS, browser

__all__ = ["browser"]


async def _offline_page(browser: Any, base: str) -> tuple[Any, list[str], list[str]]:
    """A page whose requests off `base` are aborted (and listed), and its CSP violations."""
    page = await browser.new_page()
    refused: list[str] = []
    blocked: list[str] = []
    page.on(
        "console",
        lambda message: (
            blocked.append(message.text) if "Content Security Policy" in message.text else None
        ),
    )

    async def only_local(route: Any) -> None:
        url = route.request.url
        if url.startswith(base) or url.startswith(("data:", "blob:")):
            await route.continue_()
        else:
            refused.append(url)
            await route.abort()

    await page.route("**/*", only_local)
    return page, refused, blocked


async def test_swagger_ui_authorizes_and_tries_a_guarded_route_offline(
    browser: Any, token: str
) -> None:
    async with health_nodes(token) as make:
        central = await make()
        base = central.http_url or ""
        page, refused, blocked = await _offline_page(browser, base)
        await page.goto(f"{base}/docs")
        replicas = page.locator("#operations-state-replicas_v1_replicas_get")
        await replicas.wait_for(timeout=WAIT_MS)
        await page.locator("button.authorize").first.click()
        await page.locator(".auth-container input").first.fill(token)
        await page.locator(".auth-btn-wrapper button.authorize").click()
        await page.locator(".auth-btn-wrapper button.btn-done").click()
        await replicas.locator(".opblock-summary").click()
        await replicas.locator("button.try-out__btn").click()
        await replicas.locator("button.execute").click()
        status = replicas.locator(".live-responses-table .response .response-col_status")
        await status.first.wait_for(timeout=WAIT_MS)
        assert (await status.first.inner_text()).strip().startswith("200")
        body = await replicas.locator(".live-responses-table .microlight").first.inner_text()
        assert '"replicas"' in body
        assert refused == []
        assert blocked == []


async def test_redoc_renders_the_api_offline(browser: Any, token: str) -> None:
    async with health_nodes(token) as make:
        central = await make()
        base = central.http_url or ""
        page, refused, blocked = await _offline_page(browser, base)
        await page.goto(f"{base}/redoc")
        title = page.locator("h1", has_text="fthsdp health service")
        await title.wait_for(timeout=WAIT_MS)
        await page.locator("h2", has_text="Put Detectors").wait_for(timeout=WAIT_MS)
        # The body's settings, from the schema, e.g. one with its bounds:
        await page.get_by_text("heartbeat_timeout_s").first.wait_for(
            state="attached", timeout=WAIT_MS
        )
        assert refused == []
        # ReDoc's sidebar logo comes from its vendor's CDN: the policy refuses it (and ReDoc
        # hides the image); nothing else is refused.
        assert all("cdn.redoc.ly/redoc/logo-mini.svg" in text for text in blocked), blocked
