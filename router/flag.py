"""One setting as the command line, the environment and a TOML file see it (`Flag`), read
from the field of `Settings` that declares it, and the groups `kvbaton serve --help=GROUP` and
docs/configuration.md show the flags in."""

from __future__ import annotations

import ast
import dataclasses
import enum
import functools
import inspect
import textwrap
import typing
from collections.abc import Iterator, Sequence
from dataclasses import KW_ONLY, dataclass
from typing import Annotated, Literal

import msgspec

ENV_PREFIX = "KVBATON_"


class Group(enum.Enum):
    """A heading of the help; its value is what `--help=GROUP` takes."""

    ENGINES = "engines"
    SERVER = "server"
    SESSIONS = "sessions"
    REUSE = "reuse"
    KV_EVENTS = "kv-events"
    PINS = "pins"
    LIMITS = "limits"
    SECURITY = "security"
    OBSERVABILITY = "observability"

    @property
    def about(self) -> str:
        """What the group's flags are about, in a line."""
        return _ABOUT[self]

    @property
    def title(self) -> str:
        """The group's heading in --help and docs/configuration.md."""
        return f"{self.value}: {self.about}"


_ABOUT = {
    Group.ENGINES: "the P and D instances, their connector and how they are probed",
    Group.SERVER: "where the router listens and with how many processes",
    Group.SESSIONS: "where conversations are stored and for how long",
    Group.REUSE: "when a turn reads KV from the previous D, and where a turn runs",
    Group.KV_EVENTS: "placement by what each engine already holds",
    Group.PINS: "releasing the handles on a D that nobody will read",
    Group.LIMITS: "timeouts for engines and clients, body size, ejection",
    Group.SECURITY: "the admin API's keys and session signing",
    Group.OBSERVABILITY: "logs and traces",
}


def cli_name(name: str) -> str:
    """A setting's flag: `redis_url` is `--redis-url`."""
    return "--" + name.replace("_", "-")


def env_name(name: str) -> str:
    """A setting's variable: `redis_url` is `KVBATON_REDIS_URL`."""
    return ENV_PREFIX + name.upper()


@dataclass(frozen=True)
class Flag:
    """One setting as the command line, env and file see it. A field of `Settings` declares it
    (`port: Annotated[int, Flag(Group.SERVER, metavar="PORT")] = 8000`, its help the docstring
    below); `declared` fills in the rest from the field, as `dataclasses.field()` learns its
    name from its class."""

    group: Group
    _: KW_ONLY
    # What the flag takes, as --help and docs/configuration.md show it (empty: by its type).
    metavar: str = ""
    # Needed to start (unless instances announce themselves: --moriio-register).
    required: bool = False
    # A list flag given once per value (--kv-events A --kv-events B); its values may hold
    # commas, so the environment separates them by spaces only.
    repeat: bool = False
    # Another variable read when KVBATON_<FLAG> is unset (a convention other proxies use).
    env_alias: str = ""
    # Shown by `kvbaton serve --help` alone: what a first router needs.
    first: bool = False
    # Read from the field by `declared`, never written in the declaration:
    name: str = ""
    help: str = ""  # the field's docstring
    kind: type = str  # what one value converts with (a Literal's or an Enum's: str)
    many: bool = False  # tuple[str, ...]: a list of values
    choices: tuple[str, ...] = ()  # a Literal's values, an Enum's values


def placeholder(flag: Flag) -> str:
    """The value a flag takes as help shows it: by default an int is N, a float SECONDS."""
    return flag.metavar or {int: "N", float: "SECONDS"}.get(flag.kind, "VALUE")


@functools.cache
def declared(struct: type[msgspec.Struct]) -> tuple[Flag, ...]:
    """Every field of `struct` as its Flag, in the order the fields are declared."""
    hints = typing.get_type_hints(struct, include_extras=True)
    docs = dict(_docstrings(struct))
    return tuple(_flag(struct, name, hints[name], docs) for name in struct.__struct_fields__)


def grouped(flags: Sequence[Flag]) -> list[tuple[Group, tuple[Flag, ...]]]:
    """Each group with its flags, in the order of `Group` and of the flags."""
    return [(group, tuple(flag for flag in flags if flag.group is group)) for group in Group]


def _flag(struct: type, name: str, hint: object, docs: dict[str, str]) -> Flag:
    base, *extras = typing.get_args(hint) if typing.get_origin(hint) is Annotated else (hint,)
    flag = next((extra for extra in extras if isinstance(extra, Flag)), None)
    if flag is None or not docs.get(name):
        raise TypeError(
            f"{struct.__name__}.{name}: declare it as `{name}: Annotated[TYPE, Flag(GROUP)]` "
            "with its help as a docstring below it"
        )
    kind, many, choices = _takes(base, f"{struct.__name__}.{name}")
    return dataclasses.replace(
        flag, name=name, help=docs[name], kind=kind, many=many, choices=choices
    )


def _takes(hint: object, where: str) -> tuple[type, bool, tuple[str, ...]]:
    """What one value of the type converts with, whether it is a list, its choices."""
    if typing.get_origin(hint) is tuple and typing.get_args(hint) == (str, ...):
        return str, True, ()
    if typing.get_origin(hint) is Literal:
        return str, False, tuple(str(value) for value in typing.get_args(hint))
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return str, False, tuple(str(member.value) for member in hint)
    if isinstance(hint, type) and hint in (str, int, float, bool):
        return hint, False, ()
    raise TypeError(
        f"{where}: a flag is str, int, float, bool, a Literal, an Enum or a tuple[str, ...]"
    )


def _docstrings(struct: type) -> Iterator[tuple[str, str]]:
    """Each field and the string right below it (an attribute docstring, as Sphinx and vLLM's
    config classes read them), its runs of whitespace one space; base classes first."""
    for cls in reversed(struct.__mro__):
        if not issubclass(cls, msgspec.Struct) or cls is msgspec.Struct:
            continue
        (node,) = ast.parse(textwrap.dedent(inspect.getsource(cls))).body
        assert isinstance(node, ast.ClassDef)
        for field, below in zip(node.body, node.body[1:], strict=False):
            if (
                isinstance(field, ast.AnnAssign)
                and isinstance(field.target, ast.Name)
                and isinstance(below, ast.Expr)
                and isinstance(below.value, ast.Constant)
                and isinstance(below.value.value, str)
            ):
                yield field.target.id, " ".join(below.value.value.split())
