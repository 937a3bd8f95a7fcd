"""Log formatting: JSON lines with ts, level, logger, message, and a per-turn `turn` object."""

from __future__ import annotations

import io
import json
import logging
import sys
from collections.abc import Iterator

import pytest

from router.logs import TURN_LOGGER, JsonFormatter, formatter, setup_logging, turn_fields

# The template router/turn/commit.py logs each turn with (read back when no `extra` is given).
TEMPLATE = (
    "turn request_id=%s conv=%s api=%s stream=%s p=%s d=%s reuse=%s reused_tokens=%d "
    "ttft_ms=%s e2e_ms=%.1f prompt_tokens=%s completion_tokens=%s result=%s"
)
ARGS = (
    "rid",
    "abc123",
    "chat",
    False,
    "http://p:1",
    "http://d:2",
    "hit",
    64,
    "12.5",
    20.25,
    30,
    "-",
    "committed",
)


def record(
    name: str, msg: str, args: tuple[object, ...] = (), **extra: object
) -> logging.LogRecord:
    rec = logging.LogRecord(name, logging.INFO, __file__, 1, msg, args, None)
    rec.__dict__.update(extra)
    return rec


def test_turn_line_is_read_back_into_fields() -> None:
    out = json.loads(JsonFormatter().format(record(TURN_LOGGER, TEMPLATE, ARGS)))
    assert out["level"] == "info" and out["logger"] == TURN_LOGGER
    assert out["ts"].endswith("Z") and "T" in out["ts"]
    assert out["message"] == TEMPLATE % ARGS
    assert out["turn"] == {
        "request_id": "rid",
        "conv": "abc123",
        "api": "chat",
        "stream": False,
        "p": "http://p:1",
        "d": "http://d:2",
        "reuse": "hit",
        "reused_tokens": 64,
        "ttft_ms": 12.5,
        "e2e_ms": 20.25,
        "prompt_tokens": 30,
        "completion_tokens": None,
        "result": "committed",
    }


def test_turn_fields_given_as_extra_win() -> None:
    rec = record(TURN_LOGGER, "turn done", turn={"request_id": "r", "ttft_ms": "-", "x": 1.23456})
    assert turn_fields(rec) == {"request_id": "r", "ttft_ms": None, "x": 1.235}


@pytest.mark.parametrize(
    ("name", "msg", "args"),
    [
        ("kvbaton.app", TEMPLATE, ARGS),  # another logger
        (TURN_LOGGER, "decode on %s failed: %s", ("http://d", "boom")),  # not a turn line
        (TURN_LOGGER, "turn a=%s %s", ("one", "two")),  # an argument without a name
    ],
)
def test_other_lines_have_no_turn_object(name: str, msg: str, args: tuple[object, ...]) -> None:
    out = json.loads(JsonFormatter().format(record(name, msg, args)))
    assert "turn" not in out and out["message"] == msg % args


def test_exceptions_are_one_json_field() -> None:
    try:
        raise ValueError("bad")
    except ValueError:
        rec = logging.LogRecord(
            "kvbaton.app", logging.ERROR, __file__, 1, "oops", (), sys.exc_info()
        )
    out = json.loads(JsonFormatter().format(rec))
    assert out["level"] == "error" and "ValueError: bad" in out["exc"]
    assert "\n" not in JsonFormatter().format(rec)


@pytest.fixture
def restore_root() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    knobs = ("_srcfile", "logThreads", "logProcesses", "logMultiprocessing")
    saved = {name: getattr(logging, name) for name in knobs}
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    for name, value in saved.items():
        setattr(logging, name, value)


def test_setup_logging_installs_one_root_handler(restore_root: None) -> None:
    setup_logging("warning", "json")
    root = logging.getLogger()
    assert root.level == logging.WARNING
    (handler,) = root.handlers
    assert isinstance(handler.formatter, JsonFormatter)
    assert not isinstance(formatter("text"), JsonFormatter)
    stream = io.StringIO()
    handler.setStream(stream)  # type: ignore[attr-defined]
    logging.getLogger("hypercorn.error").warning("Running on %s", "x")
    assert json.loads(stream.getvalue())["message"] == "Running on x"


def test_a_record_skips_what_no_format_shows(restore_root: None) -> None:
    setup_logging("info", "text")
    (handler,) = logging.getLogger().handlers
    stream = io.StringIO()
    handler.setStream(stream)  # type: ignore[attr-defined]
    seen: list[logging.LogRecord] = []
    handler.addFilter(lambda record: seen.append(record) or True)
    logging.getLogger(TURN_LOGGER).info("turn %s", "request_id=r1 reuse=hit")
    (record,) = seen
    # No stack walk for the caller, no thread or process look-up: none of it is printed.
    where = (record.funcName, record.lineno, record.thread, record.process)
    assert where == ("(unknown function)", 0, None, None)
    assert stream.getvalue().rstrip().endswith(" INFO kvbaton.turn turn request_id=r1 reuse=hit")


def test_a_workers_lines_say_which_worker() -> None:
    record = logging.LogRecord("kvbaton.app", logging.INFO, __file__, 1, "ready", (), None)
    assert json.loads(formatter("json", worker=1).format(record))["worker"] == 1
    assert "worker" not in json.loads(formatter("json").format(record))
    assert " INFO worker=1 kvbaton.app ready" in formatter("text", worker=1).format(record)
    assert "worker=" not in formatter("text").format(record)
