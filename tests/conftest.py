"""Fixtures shared by every test tier."""

from __future__ import annotations

import secrets

import pytest


@pytest.fixture
def token() -> str:
    """A fresh bearer token per test, so no test can pass on another's credentials."""
    return secrets.token_urlsafe(24)
