"""bench.ftar's placement of ranks on hosts, the parts without a network: which flags it accepts
(and its clear refusals), the rate in force, each rank's placement flags, and the table's link
column. The runs themselves need root and namespaces (``--hosts netns``) and are not tests."""

from __future__ import annotations

from typing import Any

import pytest

from fthsdp.bench import ftar
from fthsdp.bench.ftar_hosts import (
    DEFAULT_RATE_MBIT,
    STORE_PORT,
    link_gbs,
    placement_flags,
    resolve_rate,
)


def _refusal(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exc:
        ftar._parse(argv)
    assert exc.value.code == 2  # argparse's usage error, not a crash
    return capsys.readouterr().err


# ---- flags ------------------------------------------------------------------------------------


def test_loopback_is_the_default_and_has_no_rate() -> None:
    args = ftar._parse([])
    assert (args.hosts, args.rate_mbit) == ("loopback", None)


def test_netns_defaults_to_a_1_gbit_link() -> None:
    args = ftar._parse(["--hosts", "netns"])
    assert (args.hosts, args.rate_mbit) == ("netns", DEFAULT_RATE_MBIT) == ("netns", 1000.0)


@pytest.mark.parametrize(("flag", "rate"), [("0", 0.0), ("250", 250.0), ("2.5", 2.5)])
def test_netns_takes_a_rate_and_0_for_none(flag: str, rate: float) -> None:
    assert ftar._parse(["--hosts", "netns", "--rate-mbit", flag]).rate_mbit == rate


def test_a_rate_on_loopback_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    err = _refusal(["--rate-mbit", "1000"], capsys)
    assert "--rate-mbit needs --hosts netns" in err


@pytest.mark.parametrize("flag", ["-1", "-0.5", "100001"])
def test_a_rate_out_of_range_is_refused(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    err = _refusal(["--hosts", "netns", "--rate-mbit", flag], capsys)
    assert "--rate-mbit must be in [0, 100000] (0: no limit)" in err


def test_an_unknown_hosts_mode_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert "invalid choice: 'docker'" in _refusal(["--hosts", "docker"], capsys)


def test_resolve_rate_refuses_an_unknown_mode() -> None:
    with pytest.raises(ValueError, match="--hosts takes loopback or netns"):
        resolve_rate("ssh", None)


def test_a_loopback_worker_keeps_todays_store_and_address() -> None:
    args = ftar._parse(["--worker", "--rank", "1", "--world", "2", "--store-port", "4242"])
    assert (args.store_host, args.store_port, args.store_master) == ("127.0.0.1", 4242, False)
    assert args.bind_host == "127.0.0.1"


# ---- placement --------------------------------------------------------------------------------


def test_rank_0_hosts_the_store_on_its_own_address() -> None:
    flags = placement_flags(0, "10.0.0.1", "10.0.0.1")
    args = ftar._parse(["--worker", "--rank", "0", "--world", "3", *flags])
    assert (args.store_host, args.store_port, args.store_master) == ("10.0.0.1", STORE_PORT, True)
    assert args.bind_host == "10.0.0.1"


def test_other_ranks_bind_their_address_and_reach_rank_0s_store() -> None:
    args = ftar._parse(
        ["--worker", "--rank", "2", "--world", "3", *placement_flags(2, "10.0.0.3", "10.0.0.1")]
    )
    assert (args.store_host, args.store_port, args.store_master) == ("10.0.0.1", STORE_PORT, False)
    assert args.bind_host == "10.0.0.3"


def test_the_worker_command_leaves_rank_and_store_to_the_placement() -> None:
    argv = ftar._worker_argv(3, ftar._parse(["--hosts", "netns", "--no-peer-loss"]))
    assert argv[argv.index("--world") + 1] == "3"
    assert "--no-peer-loss" in argv
    assert not {"--rank", "--store-port", "--store-host", "--hosts"} & set(argv)


# ---- the link rate and the table --------------------------------------------------------------


def test_link_rate_in_gb_per_s() -> None:
    assert link_gbs(1000) == pytest.approx(0.125)
    assert link_gbs(0) is None
    assert link_gbs(None) is None


def _row() -> dict[str, Any]:
    return {
        "ranks": 3,
        "size_mb": 64,
        "dtype": "fp32",
        "wire_compression": "none",
        "ftar_busbw_gbs": 0.1134,
        "ftar_cpu_s_per_gb": 1.5,
        "gloo_busbw_gbs": 0.1021,
        "gloo_cpu_s_per_gb": 3.0,
        "ratio": 1.11,
        "ftar_cpu_s": 1.0,
        "gloo_cpu_s": 2.0,
    }


def test_loopbacks_table_has_no_link_column() -> None:
    table = ftar._table([_row()], [])
    assert "link" not in table
    assert "      0.11    1.500 |       0.10    3.000 |     1.11x     0.50x" in table


def test_a_limited_link_gets_its_column_and_busbw_3_decimals() -> None:
    head, _, row, legend = ftar._table([_row()], [], link=0.125).splitlines()
    assert head.endswith("| link GB/s")
    assert row.endswith("0.113    1.500 |      0.102    3.000 |     1.11x     0.50x |     0.125")
    assert "link: every host's link rate limit each way" in legend


def test_the_hosts_line_names_the_limit() -> None:
    assert ftar._hosts_line(1000.0).endswith("link rate limit: 1000 Mbit/s each way")
    assert ftar._hosts_line(0.0).endswith("link rate limit: none")
