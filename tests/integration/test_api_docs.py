"""The API description pages on real servers on port 0 (`services/common/api_docs.py`): /docs
and /redoc of the health service (central and node agent) and of a checkpoint sidecar load only
files the server itself serves, without a token; /openapi.json declares the bearer token on
every guarded operation and describes the health API's shapes. The quorum admin port (a stdlib
server with probes and /metrics only) describes no API: its /docs and /redoc are 404 alike.
`test_api_docs_browser.py` loads the pages in a real browser."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

import httpx

from fthsdp.services.checkpoint.server import CheckpointServer
from fthsdp.services.common.api_docs import ASSETS, PAGE_CSP, SECURITY_SCHEME
from fthsdp.services.common.http_auth import DOCS_ASSETS, OPEN_PATHS
from fthsdp.services.health.detectors.config import _RANGES, DetectorConfig
from tests.integration.conftest import QuorumServerFactory
from tests.integration.health_support import health_nodes
from tests.integration.test_checkpoint_support import sidecars

__all__ = ["sidecars"]

_TYPES = {
    ".js": "text/javascript",
    ".css": "text/css",
    ".png": "image/png",
    ".json": "application/json",
    "oauth2-redirect": "text/html",
}
_METHODS = {"get", "put", "post", "delete", "patch"}


def _expected_type(path: str) -> str:
    return next(kind for suffix, kind in _TYPES.items() if path.endswith(suffix))


async def _check_pages(base: str) -> dict[str, Any]:
    """Both pages, every URL they name, and the schema (returned); all without a token."""
    async with httpx.AsyncClient(base_url=base) as http:
        named: set[str] = set()
        for page in ("/docs", "/redoc"):
            response = await http.get(page)
            assert response.status_code == 200, (base, page)
            assert response.headers["content-type"].startswith("text/html")
            assert response.headers["content-security-policy"] == PAGE_CSP
            remote = set(re.findall(r"https?://[^\s'\"<>)]+", response.text))
            assert remote == set(), (base, page, remote)  # no CDN, no fonts, no validator
            named |= set(re.findall(r"""["'](/[^"'\s]*)["']""", response.text))
        assert named == DOCS_ASSETS | {"/openapi.json", "/docs/oauth2-redirect"}, named
        for path in sorted(named):
            response = await http.get(path)
            assert response.status_code == 200, (base, path)
            assert response.headers["content-type"].startswith(_expected_type(path)), path
            assert response.content, path
        served = (await http.get("/docs/swagger-ui-bundle.js")).text
        assert 'PACKAGE_VERSION:"5.' in served  # Swagger UI 5: renders OpenAPI 3.1
        return dict((await http.get("/openapi.json")).json())


def _check_bearer(schema: dict[str, Any], open_paths: frozenset[str]) -> None:
    assert schema["components"]["securitySchemes"][SECURITY_SCHEME] | {"description": ""} == {
        "type": "http",
        "scheme": "bearer",
        "description": "",
    }
    guarded = 0
    for path, item in schema["paths"].items():
        for method, operation in item.items():
            if method not in _METHODS:
                continue
            if path in open_paths:
                assert "security" not in operation, (path, method)
            else:
                assert operation["security"] == [{SECURITY_SCHEME: []}], (path, method)
                assert "401" in operation["responses"], (path, method)
                guarded += 1
    assert guarded >= 2
    assert "security" not in schema["paths"]["/livez"]["get"]
    assert schema["paths"]["/metrics"]["get"]["security"] == [{SECURITY_SCHEME: []}]


def _check_detector_body(schema: dict[str, Any]) -> None:
    body = schema["paths"]["/v1/detectors"]["put"]["requestBody"]
    settings = body["content"]["application/json"]["schema"]
    assert body["required"] is True
    assert settings["additionalProperties"] is False
    assert "required" not in settings  # a partial update
    fields = {f for f in DetectorConfig().to_dict()}
    assert set(settings["properties"]) == fields
    for name, (low, high) in _RANGES.items():
        prop = settings["properties"][name]
        assert (prop["minimum"], prop["maximum"]) == (low, high), name
        assert prop["description"], name
    assert settings["properties"]["fail_slow_policy"]["enum"] == ["report", "evict"]
    assert settings["properties"]["slow_rank_min_fraction"]["exclusiveMinimum"] == 0.5
    assert settings["properties"]["fail_slow_use_predictor"]["type"] == "boolean"
    assert "default" not in settings["properties"]["heartbeat_timeout_s"]


def _response_model(schema: dict[str, Any], path: str, method: str = "get") -> str:
    content = schema["paths"][path][method]["responses"]["200"]["content"]
    ref: str = content["application/json"]["schema"]["$ref"]
    return ref.rsplit("/", 1)[-1]


async def test_health_docs_work_offline_and_describe_the_api(token: str) -> None:
    async with health_nodes(token) as make:
        central = await make()
        agent = await make(mode="agent", central=central.grpc_address, node="node-a")
        schema = await _check_pages(central.http_url or "")
        open_paths = OPEN_PATHS | {"/", "/dashboard"}
        _check_bearer(schema, open_paths)
        _check_detector_body(schema)
        models = {
            "/v1/replicas": "Replicas",
            "/v1/incidents": "Incidents",
            "/v1/records/{kind}": "Records",
            "/v1/detectors": "DetectorSettings",
            "/v1/quorum/history": "QuorumHistory",
        }
        for path, model in models.items():
            assert _response_model(schema, path) == model, path
        assert _response_model(schema, "/v1/detectors", "put") == "DetectorSettings"
        replica = schema["components"]["schemas"]["Replica"]
        assert replica["properties"]["state"]["enum"] == ["healthy", "suspect", "down"]
        agent_schema = await _check_pages(agent.http_url or "")
        _check_bearer(agent_schema, open_paths)
        assert _response_model(agent_schema, "/v1/node") == "NodeStatus"


async def test_health_responses_keep_their_bytes(token: str) -> None:
    # An int in a float setting stays an int: the model does not turn 0 into 0.0.
    detectors = DetectorConfig(fail_slow_persist_s=0, fail_slow_settle_s=5)
    async with health_nodes(token) as make:
        central = await make(detectors=detectors)
        headers = {"authorization": f"Bearer {token}"}
        async with httpx.AsyncClient(base_url=central.http_url or "", headers=headers) as http:
            got = await http.get("/v1/detectors")
            assert got.content == json.dumps(detectors.to_dict(), separators=(",", ":")).encode()
            history = (await http.get("/v1/quorum/history")).json()
            assert history == {
                "configured": False,
                "quorum_id": 0,
                "members": [],
                "quorums": [],
                "failslow": [],
            }
            changed = await http.put("/v1/detectors", json={"fail_slow_policy": "evict"})
            assert changed.status_code == 200
            assert changed.json() == detectors.to_dict() | {"fail_slow_policy": "evict"}
            # Still DetectorConfig's own check and text, not the model's.
            refused = await http.put("/v1/detectors", json={"slow_rank_window": 0})
            assert refused.status_code == 400
            assert refused.json() == {
                "error": "invalid_argument",
                "detail": "slow_rank_window must be in 1..10000, got 0",
            }


async def test_checkpoint_docs_work_offline_and_declare_the_token(
    sidecars: Callable[..., CheckpointServer],
) -> None:
    schema = await _check_pages(sidecars().url)
    _check_bearer(schema, OPEN_PATHS)
    put = schema["paths"]["/v1/positions/{job}/{replica}"]["put"]
    assert put["security"] == [{SECURITY_SCHEME: []}]


async def test_the_quorum_admin_port_describes_no_api(
    make_quorum_server: QuorumServerFactory,
) -> None:
    quorum = await make_quorum_server()
    async with httpx.AsyncClient(base_url=f"http://{quorum.admin_address}") as http:
        for path in ("/docs", "/redoc", "/openapi.json", *sorted(DOCS_ASSETS)):
            assert (await http.get(path)).status_code == 404, path


def test_the_open_asset_paths_are_the_served_ones() -> None:
    assert set(ASSETS) == DOCS_ASSETS <= OPEN_PATHS
