"""The one logging setup (`services.common.logs`): the `extra` context is printed in both formats,
JSON lines parse, a value JSON cannot encode is written as its str(), and a second setup replaces
the first instead of doubling every line."""

from __future__ import annotations

import argparse
import io
import json
import logging
from datetime import datetime

import pytest

from fthsdp.services.common import logs
from fthsdp.services.common.cli import add_flags, setup_logging


def _lines(out: io.StringIO) -> list[str]:
    return out.getvalue().splitlines()


def test_text_prints_the_extra_context_after_the_message() -> None:
    out = io.StringIO()
    logs.configure("INFO", "text", stream=out)
    logging.getLogger("fthsdp.test").info(
        "committed %s", "ok", extra={"replica": "r1", "step": 7, "cause": "peer gone"}
    )
    (line,) = _lines(out)
    assert " INFO fthsdp.test: committed ok replica=r1 step=7 " in line
    # A value with a space is quoted, so the line still splits into its fields.
    assert line.endswith(' cause="peer gone"')


def test_text_without_context_is_the_plain_line() -> None:
    out = io.StringIO()
    logs.configure("INFO", "text", stream=out)
    logging.getLogger("fthsdp.test").warning("plain")
    (line,) = _lines(out)
    assert line.endswith(" WARNING fthsdp.test: plain")


def test_json_lines_carry_the_fields_the_context_and_the_traceback() -> None:
    out = io.StringIO()
    logs.configure("DEBUG", "json", stream=out)
    log = logging.getLogger("fthsdp.test")
    log.debug("step %d", 7, extra={"replica": "r1", "step": 7})
    try:
        raise RuntimeError("bad peer")
    except RuntimeError:
        log.exception("fetch failed", extra={"replica": "r2"})
    first, second = (json.loads(line) for line in _lines(out))
    assert first["level"] == "DEBUG"
    assert first["logger"] == "fthsdp.test"
    assert first["msg"] == "step 7"
    assert (first["replica"], first["step"]) == ("r1", 7)
    assert "exc" not in first
    ts = datetime.fromisoformat(first["ts"])
    assert ts.utcoffset() is not None and ts.utcoffset().total_seconds() == 0  # type: ignore[union-attr]
    assert second["level"] == "ERROR" and second["replica"] == "r2"
    assert second["exc"].startswith("Traceback (most recent call last):")
    assert "RuntimeError: bad peer" in second["exc"]


def test_json_writes_an_unserialisable_value_as_its_str() -> None:
    class Peer:
        def __str__(self) -> str:
            return "peer r3"

    out = io.StringIO()
    logs.configure("INFO", "json", stream=out)
    logging.getLogger("fthsdp.test").info("x", extra={"peer": Peer(), "ranks": (0, 1)})
    (line,) = (json.loads(text) for text in _lines(out))
    assert line["peer"] == "peer r3"
    assert line["ranks"] == [0, 1]


def test_a_context_field_never_replaces_a_fixed_one() -> None:
    out = io.StringIO()
    logs.configure("INFO", "json", stream=out)
    logging.getLogger("fthsdp.test").info("x", extra={"ts": "fake", "level": "fake"})
    (line,) = (json.loads(text) for text in _lines(out))
    assert line["level"] == "INFO" and line["ts"] != "fake"
    assert (line["extra_ts"], line["extra_level"]) == ("fake", "fake")


def test_configure_twice_keeps_one_handler_with_the_latest_settings() -> None:
    first, second = io.StringIO(), io.StringIO()
    logs.configure("INFO", "text", stream=first)
    logs.configure("WARNING", "json", stream=second)
    ours = [h for h in logging.getLogger().handlers if isinstance(h, logs._Handler)]
    assert len(ours) == 1
    log = logging.getLogger("fthsdp.test")
    log.info("dropped: below the new level")
    log.warning("once")
    assert first.getvalue() == ""
    (line,) = _lines(second)
    assert json.loads(line)["msg"] == "once"


def test_configure_again_after_the_old_stream_was_closed() -> None:
    # A CLI run under a redirect that has ended (pytest's capture of an earlier test) left the
    # handler on a closed stream; the next configure must not fail flushing it.
    first, second = io.TextIOWrapper(io.BytesIO()), io.StringIO()
    logs.configure("INFO", "text", stream=first)
    first.close()
    logs.configure("INFO", "text", stream=second)
    logging.getLogger("fthsdp.test").warning("after")
    assert _lines(second)[-1].endswith("after")


def test_fields_are_stamped_on_every_record_unless_it_has_its_own() -> None:
    out = io.StringIO()
    logs.configure("INFO", "text", stream=out, fields={"replica_id": "r0", "rank": 1})
    log = logging.getLogger("fthsdp.test")
    log.info("a")
    log.info("b", extra={"rank": 5})
    a, b = _lines(out)
    assert a.endswith("a replica_id=r0 rank=1")
    assert b.endswith("b rank=5 replica_id=r0")


def test_unknown_level_or_format_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="log level"):
        logs.configure("LOUD", "text")
    with pytest.raises(ValueError, match="log format"):
        logs.configure("INFO", "xml")


def _service_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_flags(parser, "FTHSDP_TEST_", ())
    return parser.parse_args(argv)


def test_setup_logging_takes_the_flag_then_the_environment(
    capsys: pytest.CaptureFixture[str],
) -> None:
    setup_logging(_service_args([]), {"FTHSDP_LOG_FORMAT": "json", "FTHSDP_LOG_LEVEL": "error"})
    log = logging.getLogger("fthsdp.test")
    log.warning("below error")
    log.error("from env", extra={"step": 3})
    (line,) = capsys.readouterr().err.splitlines()
    assert json.loads(line)["step"] == 3
    setup_logging(_service_args(["--log-format", "text"]), {"FTHSDP_LOG_FORMAT": "json"})
    log.info("from flag", extra={"step": 4})
    (line,) = capsys.readouterr().err.splitlines()
    assert line.endswith("from flag step=4")


def test_setup_logging_names_a_bad_variable() -> None:
    with pytest.raises(ValueError, match="FTHSDP_LOG_FORMAT"):
        setup_logging(_service_args([]), {"FTHSDP_LOG_FORMAT": "yaml"})
    with pytest.raises(ValueError, match="FTHSDP_LOG_LEVEL"):
        setup_logging(_service_args([]), {"FTHSDP_LOG_LEVEL": "chatty"})


def test_every_service_flag_set_documents_log_format() -> None:
    parser = argparse.ArgumentParser()
    add_flags(parser, "FTHSDP_TEST_", ())
    text = parser.format_help()
    assert "--log-format {text,json}" in text
    assert "FTHSDP_LOG_FORMAT" in text
    with pytest.raises(SystemExit):
        parser.parse_args(["--log-format", "xml"])
