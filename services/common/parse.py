"""Parsing of the small texts every service takes from outside (addresses, header numbers): one
definition, so a check cannot be stricter in one place than in another.

Digits are ASCII only: `str.isdigit` also accepts superscripts (`²`, which `int` then refuses)
and `int` accepts fullwidth and Arabic-Indic digits, which would be stored and echoed back."""

from __future__ import annotations

MAX_PORT = 65535
MAX_STEP = 1 << 62
"""The largest training step any service accepts (one bound for all of them: a step the quorum
service took must be one the checkpoint and health services take too)."""


def ascii_int(text: str) -> int | None:
    """The value of a non-empty string of ASCII digits; None for anything else."""
    if not text or not text.isascii() or not text.isdigit():
        return None
    return int(text)


def host_port(address: str) -> tuple[str, int]:
    """`host:port` (`[v6]:port` for IPv6) as (host, port), brackets removed; ValueError unless
    the host is non-empty and the port is ASCII digits in 1..65535."""
    host, sep, text = address.rpartition(":")
    port = ascii_int(text)
    if not sep or not host or port is None or not 0 < port <= MAX_PORT:
        raise ValueError(f"{address!r} is not host:port (port 1..{MAX_PORT})")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, port
