"""kvbaton: the multi-turn P/D conversation router (ASGI app, CLI, per-turn flow)."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version


def kvbaton_version() -> str:
    """The installed distribution's version (a source tree run without installing has none)."""
    try:
        return version("kvbaton")
    except PackageNotFoundError:
        return "unknown (not installed)"
