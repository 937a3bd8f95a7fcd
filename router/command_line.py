"""The `kvbaton serve` command line: one argparse option per field of `Settings`, in its
help group, each with what it takes, its default and its variable. `--help` alone shows the
first flags and names the groups; `--help=GROUP` one group, `--help=all` every flag (as
`vllm serve` does). `config.py` turns what it parses into `Settings`."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from router import kvbaton_version, vllm_router_flags
from router.flag import Flag, Group, cli_name, declared, env_name, grouped, placeholder

USAGE = "%(prog)s --prefill URL [URL ...] --decode URL [URL ...] [options]"
DESCRIPTION = """\
Route multi-turn conversations over vLLM prefill/decode instances, reusing each
conversation's KV cache from the previous decode node. Every flag is also read from
the environment as KVBATON_<FLAG> (e.g. KVBATON_REDIS_URL)."""
ALL = "all"


def build_parser(
    defaults: msgspec.Struct, prog: str = "kvbaton serve", topic: str = ALL
) -> argparse.ArgumentParser:
    """The parser; `defaults` (a `Settings` built with no values) gives the flags, from its
    type's fields, and the defaults shown.
    Every option defaults to None, so that `config.py` can tell a flag given from one not.
    `topic` is what its help shows: "all", a group's name, or "" (the summary)."""
    parser = argparse.ArgumentParser(
        prog=prog,
        usage=USAGE,
        description=DESCRIPTION,
        add_help=False,
        formatter_class=argparse.RawDescriptionHelpFormatter,  # the epilog's table as written
    )
    general = parser.add_argument_group("options")
    general.add_argument(
        "-h",
        "--help",
        nargs="?",
        const="",
        metavar="GROUP",
        action=_Help,
        render=lambda topic: build_parser(defaults, prog, topic).format_help(),
        help="show the first flags and the groups; --help=GROUP one group's flags, "
        f"--help={ALL} every flag",
    )
    general.add_argument(
        "--config", metavar="FILE", help="TOML file with settings (keys as flag names)"
    )
    general.add_argument("--version", action="version", version=f"kvbaton {kvbaton_version()}")
    flags = declared(type(defaults))
    if topic == "":
        first = parser.add_argument_group("the flags to start with")
        for flag in flags:
            if flag.first:
                _add(first, flag, defaults)
        parser.epilog = _groups_epilog(prog, flags)
    for group, members in grouped(flags):
        visible = topic in (ALL, group.value)
        container = parser.add_argument_group(group.title) if visible else parser
        for flag in members:
            if topic == "" and flag.first:
                continue  # added above
            _add(container, flag, defaults, hidden=not visible)
    vllm_router_flags.add_to(parser)
    return parser


def _groups_epilog(prog: str, flags: tuple[Flag, ...]) -> str:
    lines = [f"The other flags, by group ({prog} --help=GROUP; --help={ALL}: every flag):"]
    counts = {group: len(members) for group, members in grouped(flags)}
    width = max(len(group.value) for group in Group)
    for group in Group:
        lines.append(f"  {group.value:<{width}}  {group.about} ({counts[group]} flags)")
    return "\n".join(lines)


class _Help(argparse.Action):
    """`--help[=GROUP]`: print that help and exit; an unknown group is a usage error naming
    the groups."""

    def __init__(self, *args: Any, render: Callable[[str], str], **kwargs: Any) -> None:
        kwargs["default"] = argparse.SUPPRESS  # not in the namespace when not given
        super().__init__(*args, **kwargs)
        self.render = render

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        topic = str(values or "")
        names = [group.value for group in Group]
        if topic and topic not in (ALL, *names):
            parser.error(
                f"--help={topic}: no such group; the groups are {', '.join(names)}, or {ALL}"
            )
        print(self.render(topic), end="")  # help goes to stdout, as argparse's own
        parser.exit()


def _add(container: Any, flag: Flag, defaults: msgspec.Struct, hidden: bool = False) -> None:
    """The flag's option; a hidden one (not in the help shown) still parses."""
    default = getattr(defaults, flag.name)
    shown = f" (default: {default})" if not flag.many else ""
    help_text = f"{flag.help}{shown} [env {env_name(flag.name)}]"
    if hidden:
        help_text = argparse.SUPPRESS
    if flag.kind is bool:
        container.add_argument(
            cli_name(flag.name),
            dest=flag.name,
            default=None,
            action=argparse.BooleanOptionalAction,
            help=help_text,
        )
    elif flag.many:
        container.add_argument(
            cli_name(flag.name),
            dest=flag.name,
            nargs=1 if flag.repeat else "+",  # repeated, they add up (--prefill A --prefill B)
            action=vllm_router_flags.PrefillUrls if flag.name == "prefill" else "extend",
            default=None,
            metavar=placeholder(flag),
            help=help_text,
        )
    else:
        container.add_argument(
            cli_name(flag.name),
            dest=flag.name,
            default=None,
            type=flag.kind,
            choices=flag.choices or None,
            metavar=None if flag.choices else placeholder(flag),  # choices show themselves
            help=help_text,
        )


def parse(parser: argparse.ArgumentParser, argv: Sequence[str]) -> dict[str, Any]:
    """The flags given (None: not given); ConfigError for a vllm-router spelling kvbaton
    refuses, naming what to write instead."""
    vllm_router_flags.check_values(argv)
    return vars(parser.parse_args(list(argv)))
