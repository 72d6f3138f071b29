"""Addresses and header numbers: ASCII digits only, ports in range, one definition."""

from __future__ import annotations

import pytest

from fthsdp.services.common.parse import ascii_int, host_port


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
