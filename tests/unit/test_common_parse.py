"""Addresses and header numbers: ASCII digits only, ports in range, one definition."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from fthsdp.services.common.parse import MAX_STEP, ascii_int, host_port


@pytest.mark.parametrize(
    ("address", "expected"),
    [("h:1", ("h", 1)), ("10.0.0.1:65535", ("10.0.0.1", 65535)), ("[::1]:80", ("::1", 80))],
)
def test_a_host_and_port(address: str, expected: tuple[str, int]) -> None:
    assert host_port(address) == expected


@pytest.mark.parametrize(
    "address",
    ["h", ":80", "h:", "h:0", "h:65536", "h:²", "h:１２", "h:٣٣", "h:+80", "h: 80", "h:8_0"],
)
def test_not_a_host_and_port(address: str) -> None:
    with pytest.raises(ValueError):
        host_port(address)


def test_only_ascii_digits_are_a_number() -> None:
    assert ascii_int("0042") == 42
    for text in ("", "²", "１", "-1", "1.0", " 1", "1e3"):
        assert ascii_int(text) is None, text


def test_every_service_takes_the_same_largest_step() -> None:
    """The quorum service took steps up to 2**63 - 1 that checkpoint and health then refused."""
    from fthsdp.services.checkpoint import client_manifest
    from fthsdp.services.health import domain
    from fthsdp.services.quorum import core

    checks: list[tuple[Callable[[int], int], type[Exception]]] = [
        (core.check_step, core.InvalidRequestError),
        (domain.check_step, domain.InvalidReportError),
        (client_manifest.check_step, client_manifest.InvalidArgumentError),
    ]
    for check, invalid in checks:
        assert check(MAX_STEP) == MAX_STEP
        with pytest.raises(invalid):
            check(MAX_STEP + 1)
