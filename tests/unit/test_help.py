"""`kvbaton serve --help` fits on a screen; `--help=GROUP` shows each group, `--help=all`
every flag, each in one group; an unknown group is a usage error naming the groups."""

from __future__ import annotations

import re

import pytest

from router.command_line import ALL
from router.config import FLAGS, load_settings
from router.flag import Group, cli_name, grouped

FIRST = tuple(flag.name for flag in FLAGS if flag.first)
GROUPS = {group: tuple(flag.name for flag in flags) for group, flags in grouped(FLAGS)}


def help_text(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    with pytest.raises(SystemExit) as done:
        load_settings(list(argv), env={})
    assert done.value.code == 0
    out, err = capsys.readouterr()
    assert err == ""
    return out


def flags_in(text: str) -> set[str]:
    """The kvbaton flags a help text lists as options (at the start of a line)."""
    listed = set(re.findall(r"^  (--[a-z][\w-]*)", text, re.MULTILINE))
    return listed & {cli_name(flag.name) for flag in FLAGS}


@pytest.fixture(autouse=True)
def _screen(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "80")  # argparse wraps to the terminal; a narrow one


@pytest.mark.parametrize("argv", [["--help"], ["-h"]])
def test_help_alone_fits_on_a_screen(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    text = help_text(capsys, *argv)
    assert len(text.splitlines()) <= 60, text
    assert text.startswith("usage: kvbaton serve --prefill URL")
    assert flags_in(text) == {cli_name(name) for name in FIRST}
    for group in Group:
        assert re.search(rf"^  {re.escape(group.value)}  ", text, re.MULTILINE), group
    assert "--help=GROUP" in text and "--help=all" in text


def test_every_group_has_flags_and_the_summary_what_a_first_router_needs() -> None:
    assert all(GROUPS.values())
    assert FIRST == (
        "prefill",
        "decode",
        "host",
        "port",
        "redis_url",
        "session_store",
        "session_secret",
    )


@pytest.mark.parametrize("group", list(Group), ids=lambda g: g.value)
def test_each_group_is_reachable(group: Group, capsys: pytest.CaptureFixture[str]) -> None:
    for argv in ([f"--help={group.value}"], ["--help", group.value]):
        text = help_text(capsys, *argv)
        assert group.title in text
        assert flags_in(text) == {cli_name(name) for name in GROUPS[group]}


def test_help_all_lists_every_flag_under_its_group(capsys: pytest.CaptureFixture[str]) -> None:
    text = help_text(capsys, f"--help={ALL}")
    assert flags_in(text) == {cli_name(flag.name) for flag in FLAGS}
    for flag in FLAGS:
        assert f"KVBATON_{flag.name.upper()}" in text.replace("\n", "").replace(" ", "")
    headings = [text.index(f"\n{group.title}:\n") for group in Group]
    assert headings == sorted(headings)
    for group, names in GROUPS.items():  # each flag below its own heading, above the next
        start = text.index(f"\n{group.title}:\n")
        end = min((h for h in headings if h > start), default=len(text))
        assert flags_in(text[start:end]) == {cli_name(name) for name in names}


def test_an_unknown_group_names_the_groups(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        load_settings(["--help=colours"], env={})
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert "--help=colours: no such group" in err
    for group in Group:
        assert group.value in err
    assert ALL in err


def test_flags_hidden_from_a_summary_still_parse() -> None:
    """The summary and group views are help only: the parser takes every flag."""
    argv = ["--prefill", "http://p:1", "--decode", "http://d:1", "--pin-low-water", "0.5"]
    assert load_settings(argv, env={}).pin_low_water == 0.5
