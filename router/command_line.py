"""The `kvbaton serve` command line: one argparse option per setting in `flags.FLAGS`, each
with what it takes, its default and its variable. `config.py` turns what it parses into
`Settings`."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from router import kvbaton_version, vllm_router_flags
from router.flags import FLAGS, cli_name, env_name, placeholder


def build_parser(defaults: object, prog: str = "kvbaton serve") -> argparse.ArgumentParser:
    """The parser; `defaults` (a `Settings` built with no values) gives the defaults shown.
    Every option defaults to None, so that `config.py` can tell a flag given from one not."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Route multi-turn conversations over vLLM prefill/decode instances, "
        "reusing each conversation's KV cache from the previous decode node. Every flag is "
        "also read from the environment as KVBATON_<FLAG> (e.g. KVBATON_REDIS_URL).",
    )
    parser.add_argument(
        "--config", metavar="FILE", help="TOML file with settings (keys as flag names)"
    )
    parser.add_argument("--version", action="version", version=f"kvbaton {kvbaton_version()}")
    for flag in FLAGS:
        default = getattr(defaults, flag.name)
        shown = f" (default: {default})" if not flag.many else ""
        help_text = f"{flag.help}{shown} [env {env_name(flag.name)}]"
        if flag.kind is bool:
            parser.add_argument(
                cli_name(flag.name),
                dest=flag.name,
                default=None,
                action=argparse.BooleanOptionalAction,
                help=help_text,
            )
        elif flag.many:
            parser.add_argument(
                cli_name(flag.name),
                dest=flag.name,
                nargs=1 if flag.repeat else "+",  # repeated, they add up (--prefill A --prefill B)
                action=vllm_router_flags.PrefillUrls if flag.name == "prefill" else "extend",
                default=None,
                metavar=placeholder(flag),
                help=help_text,
            )
        else:
            parser.add_argument(
                cli_name(flag.name),
                dest=flag.name,
                default=None,
                type=flag.kind,
                choices=flag.choices or None,
                metavar=None if flag.choices else placeholder(flag),  # choices show themselves
                help=help_text,
            )
    vllm_router_flags.add_to(parser)
    return parser


def parse(parser: argparse.ArgumentParser, argv: Sequence[str]) -> dict[str, Any]:
    """The flags given (None: not given); ConfigError for a vllm-router spelling kvbaton
    refuses, naming what to write instead."""
    vllm_router_flags.check_values(argv)
    return vars(parser.parse_args(list(argv)))
