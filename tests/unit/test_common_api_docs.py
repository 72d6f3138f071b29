"""`services/common/api_docs.py` without a server: what it refuses, and the schema it derives
from the open paths."""

from __future__ import annotations

import pytest
from fastapi import FastAPI

from fthsdp.services.common.api_docs import ASSET_DIR, ASSETS, SECURITY_SCHEME, install_docs


def test_an_app_with_fastapis_cdn_pages_is_refused() -> None:
    with pytest.raises(ValueError, match="docs_url=None"):
        install_docs(FastAPI())
    with pytest.raises(ValueError, match="OpenAPI"):
        install_docs(FastAPI(docs_url=None, redoc_url=None, openapi_url=None))


def test_the_shipped_files_are_there() -> None:
    for name, _ in ASSETS.values():
        assert (ASSET_DIR / name).stat().st_size > 1000, name


def test_only_operations_outside_the_open_paths_require_the_token() -> None:
    app = FastAPI(docs_url=None, redoc_url=None)

    @app.get("/livez")
    async def livez() -> dict[str, str]:
        return {}

    @app.put("/v1/thing/{name}")
    async def thing(name: str) -> dict[str, str]:
        return {}

    install_docs(app, open_paths={"/livez"})
    schema = app.openapi()
    assert schema["components"]["securitySchemes"][SECURITY_SCHEME]["scheme"] == "bearer"
    assert "security" not in schema["paths"]["/livez"]["get"]
    guarded = schema["paths"]["/v1/thing/{name}"]["put"]
    assert guarded["security"] == [{SECURITY_SCHEME: []}]
    assert guarded["responses"]["401"]["description"]
    assert app.openapi() is schema  # built once, cached
    assert not any(path.startswith("/docs") for path in schema["paths"])
