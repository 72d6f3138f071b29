"""One auth rule on every HTTP endpoint of fthsdp (`services/common/http_auth.py`), checked on
real servers on port 0: the quorum service's admin port, the health service, a checkpoint
sidecar. The probes and the API's description answer without a token; /metrics and the API do
not, and do with the token."""

from __future__ import annotations

from collections.abc import Callable

import httpx

from fthsdp.services.checkpoint.server import CheckpointServer
from fthsdp.services.common.http_auth import OPEN_PATHS
from tests.integration.conftest import QuorumServerFactory
from tests.integration.health_support import health_nodes
from tests.integration.test_checkpoint_support import sidecars

__all__ = ["sidecars"]

_DESCRIBED = ("/openapi.json", "/docs", "/redoc")
"""The description pages of the FastAPI services (the quorum admin port has no API to describe)."""


async def _check(
    base: str, token: str, *, open_paths: tuple[str, ...], guarded: tuple[str, ...]
) -> None:
    async with httpx.AsyncClient(base_url=base) as http:
        for path in open_paths:
            assert (await http.get(path)).status_code == 200, (base, path)
        for path in guarded:
            for headers in ({}, {"authorization": "Bearer wrong-token-wrong-token"}):
                refused = await http.get(path, headers=headers)
                assert refused.status_code == 401, (base, path, headers)
                assert refused.json()["error"] == "unauthorized"
            granted = await http.get(path, headers={"authorization": f"Bearer {token}"})
            assert granted.status_code == 200, (base, path)


async def test_every_service_follows_the_one_rule(
    make_quorum_server: QuorumServerFactory,
    sidecars: Callable[..., CheckpointServer],
    token: str,
) -> None:
    assert {"/livez", "/readyz", *_DESCRIBED} <= OPEN_PATHS
    assert "/metrics" not in OPEN_PATHS
    probes = ("/livez", "/readyz")
    quorum = await make_quorum_server()
    await _check(f"http://{quorum.admin_address}", token, open_paths=probes, guarded=("/metrics",))
    async with health_nodes(token) as make:
        central = await make()
        await _check(
            central.http_url or "",
            token,
            open_paths=probes + _DESCRIBED,
            guarded=("/metrics", "/v1/replicas"),
        )
    sidecar = sidecars()
    await _check(
        sidecar.url,
        token,
        open_paths=probes + _DESCRIBED,
        guarded=("/metrics", "/v1/snapshots/job/r0/0"),
    )
