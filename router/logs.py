"""Log formatting: plain text, or one JSON object per line (`--log-format json`).

In JSON, the per-turn line (logger `kvbaton.turn`) also carries its fields as a `turn` object.
"""

from __future__ import annotations

import logging
import re
import sys
from datetime import UTC, datetime
from typing import Any

import msgspec

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"
TURN_LOGGER = "kvbaton.turn"

# `key=%s`, `key=%d`, `key=%.1f` placeholders of a `turn ...` message, in order.
_PLACEHOLDER = re.compile(r"(\w+)=%[-#0-9.]*[sdifr]")
_NUMBER = re.compile(r"-?\d+(\.\d+)?")
_encode = msgspec.json.Encoder(enc_hook=str).encode


def _value(raw: Any) -> Any:
    """Numbers pre-formatted as text become numbers again; a "-" placeholder becomes null."""
    if isinstance(raw, str):
        if raw == "-":
            return None
        if _NUMBER.fullmatch(raw):
            return float(raw) if "." in raw else int(raw)
    if isinstance(raw, float):
        return round(raw, 3)
    return raw


def turn_fields(record: logging.LogRecord) -> dict[str, Any] | None:
    """The structured fields of a per-turn line: `extra={"turn": {...}}` if the caller gave
    them, else read back from the `turn key=%s ...` template and its arguments."""
    given = getattr(record, "turn", None)
    if isinstance(given, dict):
        return {str(k): _value(v) for k, v in given.items()}
    if record.name != TURN_LOGGER or not isinstance(record.msg, str):
        return None
    if not record.msg.startswith("turn ") or not isinstance(record.args, tuple):
        return None
    names = _PLACEHOLDER.findall(record.msg)
    if len(names) != len(record.args):
        return None
    return {name: _value(arg) for name, arg in zip(names, record.args, strict=True)}


class JsonFormatter(logging.Formatter):
    """`{"ts", "level", "logger", "message"}` plus `worker`, `turn` and `exc` when there are
    any."""

    def __init__(self, worker: int | None = None) -> None:
        super().__init__()
        self.worker = worker

    def format(self, record: logging.LogRecord) -> str:
        ts = datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds")
        out: dict[str, Any] = {
            "ts": ts.replace("+00:00", "Z"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        if self.worker is not None:
            out["worker"] = self.worker
        fields = turn_fields(record)
        if fields is not None:
            out["turn"] = fields
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:
            out["exc"] = record.exc_text
        return _encode(out).decode()


def formatter(log_format: str, worker: int | None = None) -> logging.Formatter:
    """With `--workers N`, each worker's lines say which one (`worker` from 0)."""
    if log_format == "json":
        return JsonFormatter(worker)
    if worker is None:
        return logging.Formatter(TEXT_FORMAT)
    return logging.Formatter(TEXT_FORMAT.replace("%(name)s", f"worker={worker} %(name)s"))


def setup_logging(level: str, log_format: str, worker: int | None = None) -> None:
    """One stderr handler on the root logger; every logger (Hypercorn's too) propagates to it.

    Neither format shows where a line was logged from, nor the thread or process: a record
    skips finding them (the logging HOWTO's *Optimization*), which was most of the cost of a
    turn's line.
    """
    logging._srcfile = None  # no stack walk for the caller
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter(log_format, worker))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
