"""Each setting is declared once, as a field of `Settings`: the parser, the environment, a TOML
file and docs/configuration.md (generated and kept in sync) follow from the field; every flag
works from the environment and from a TOML file (precedence itself: tests/unit/test_config.py)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any

import pytest

from router import config_docs
from router.config import FLAGS, Flag, Settings, build_parser, load_settings
from router.errors import ConfigError
from router.flag import Group, cli_name, declared, env_name

DEFAULTS = Settings(prefill=(), decode=())
URLS = ["--prefill", "http://p:1", "--decode", "http://d:1"]


def test_configuration_md_is_generated_from_the_flags() -> None:
    committed = config_docs.DOC_PATH.read_text()
    assert committed == config_docs.render(), "run: python -m router.config_docs"
    assert config_docs.main(["--check"]) == 0
    for flag in FLAGS:
        assert f"`KVBATON_{flag.name.upper()}`" in committed
        assert f"`{flag.name}`" in committed


def test_only_the_instance_lists_are_marked_required() -> None:
    """--data-parallel-size, --prefill-coordinates and --kv-events are optional lists; only
    --prefill and --decode are needed to start (unless instances announce themselves)."""
    committed = config_docs.DOC_PATH.read_text()
    required = re.findall(r"^\| `(--[\w-]+)[^|]*\|[^|]*\|[^|]*\| \(required\) \|", committed, re.M)
    assert required == ["--prefill", "--decode"]
    assert {f.name for f in FLAGS if f.required} == {"prefill", "decode"}
    for flag in ("--data-parallel-size URL=N", "--kv-events ENGINE_URL=ZMQ_ENDPOINT[,REPLAY]"):
        assert f"| `{flag}` (repeatable) |" in committed


def test_check_fails_when_out_of_date(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "configuration.md"
    monkeypatch.setattr(config_docs, "DOC_PATH", target)
    assert config_docs.main(["--check"]) == 1
    assert config_docs.main([]) == 0
    assert target.read_text() == config_docs.render()
    assert config_docs.main(["--check"]) == 0
    assert config_docs.main(["--bogus"]) == 2
    assert "out of date" in capsys.readouterr().err


REPEATED = {
    "kv_events": ("http://x:1=tcp://x:5557", "http://y:2=tcp://y:7,tcp://y:9"),
    "prefill_coordinates": ("http://x:1=e1@x:5600", "http://y:2=e2@y:5601,tp=2,pp=1"),
    "data_parallel_size": ("http://x:1=2", "http://y:2=4"),
}


def sample(flag: Flag) -> Any:
    """A valid value different from the default."""
    default = getattr(DEFAULTS, flag.name)
    if flag.repeat:  # URL=VALUE flags: values with commas, one per flag
        return REPEATED[flag.name]
    if flag.name in SAMPLES:
        return SAMPLES[flag.name]
    if flag.many:
        return ("http://x:1", "http://y:2")
    if flag.kind is bool:
        return not default
    if flag.choices:
        return next((c for c in flag.choices if c != default), default)  # one choice yet
    if flag.kind is int:
        return default + 7
    if flag.kind is float:
        return default + 1.5
    return f"sample-{flag.name}"


# Flags that only go with others (the rest of the command line they need).
COMPANIONS = {"moriio_register": ["--kv-connector", "moriio"]}
SAMPLES = {"moriio_register": "tcp://127.0.0.1:5999", "pin_high_water": 0.95, "pin_low_water": 0.5}


def base_argv(flag: Flag) -> list[str]:
    argv = list(COMPANIONS.get(flag.name, []))
    for role in ("prefill", "decode"):
        if flag.name != role:
            argv += [f"--{role}", f"http://{role}:1"]
    return argv


def env_text(value: Any, flag: Flag | None = None) -> str:
    if isinstance(value, tuple):
        return (" " if flag is not None and flag.repeat else ", ").join(value)
    if isinstance(value, bool):
        return "yes" if value else "off"
    return str(value)


def toml_text(value: Any) -> str:
    if isinstance(value, tuple):
        return "[" + ", ".join(f'"{v}"' for v in value) + "]"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    return str(value)


@pytest.mark.parametrize("flag", FLAGS, ids=lambda f: f.name)
def test_every_flag_works_from_env_and_from_a_toml_file(flag: Flag, tmp_path: Path) -> None:
    value = sample(flag)
    env = {f"KVBATON_{flag.name.upper()}": env_text(value, flag)}
    from_env = load_settings(base_argv(flag), env=env)
    assert getattr(from_env, flag.name) == value
    conf = tmp_path / "kvbaton.toml"
    conf.write_text(f"{flag.name.replace('_', '-')} = {toml_text(value)}\n")
    from_file = load_settings(base_argv(flag), env={"KVBATON_CONFIG": str(conf)})
    assert getattr(from_file, flag.name) == value


def test_kv_events_repeats_and_keeps_its_commas() -> None:
    argv = ["--prefill", "http://p:1", "--decode", "http://d:1"]
    argv += ["--kv-events", "http://p:1=tcp://p:5557,tcp://p:6000"]
    argv += ["--kv-events", "http://d:1=tcp://d:5557", "--kv-events-port", "5600"]
    settings = load_settings(argv, env={})
    assert settings.kv_events == ("http://p:1=tcp://p:5557,tcp://p:6000", "http://d:1=tcp://d:5557")
    assert settings.kv_events_port == 5600
    with pytest.raises(ConfigError):
        load_settings([*argv[:4], "--kv-events", "http://p:1=localhost:5557"], env={})


class Knobs(Settings, frozen=True, kw_only=True):
    """`Settings` and one setting more, declared here and nowhere else."""

    new_knob: Annotated[int, Flag(Group.LIMITS, metavar="KNOBS")] = 3
    """a knob only this test declares"""


class Unflagged(Settings, frozen=True, kw_only=True):
    bare: int = 0
    """a field without its Flag"""


class Unhelped(Settings, frozen=True, kw_only=True):
    quiet: Annotated[int, Flag(Group.LIMITS)] = 0


class Untaken(Settings, frozen=True, kw_only=True):
    ports: Annotated[tuple[int, ...], Flag(Group.LIMITS)] = ()
    """a type no flag takes"""


def option_strings(settings_type: type[Settings] = Settings) -> set[str]:
    """Every option the `kvbaton serve` parser takes."""
    parser = build_parser(settings_type=settings_type)
    return {option for action in parser._actions for option in action.option_strings}


def doc_row(name: str) -> re.Pattern[str]:
    """The row of docs/configuration.md for a setting: its flag, its variable, its key."""
    flag, variable = re.escape(cli_name(name)), re.escape(env_name(name))
    return re.compile(rf"^\| `{flag}[ `][^|]*\| `{variable}`[^|]*\| `{name}` \|", re.M)


def test_every_field_is_a_flag_a_variable_and_a_row_of_the_docs() -> None:
    """The parser and docs/configuration.md list each field of Settings by the names derived
    from it; FLAGS is the fields, so each variable and key is read (the test above)."""
    assert [flag.name for flag in FLAGS] == list(Settings.__struct_fields__)
    taken, committed = option_strings(), config_docs.DOC_PATH.read_text()
    for name in Settings.__struct_fields__:
        assert env_name(name) == "KVBATON_" + name.upper()
        assert cli_name(name) == "--" + name.replace("_", "-")
        assert cli_name(name) in taken, name
        assert doc_row(name).search(committed), name
    assert len(re.findall(r"^\| `--", committed, re.M)) == len(FLAGS)  # and nothing else


def test_a_setting_declared_once_is_a_flag_a_variable_a_key_and_a_row(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A field added to the declaration alone (Knobs: Settings and `new_knob`) is a flag with
    its help and default, a variable, a TOML key and a row of docs/configuration.md."""
    monkeypatch.setenv("COLUMNS", "200")  # one line per flag in the help
    assert "--new-knob" in option_strings(Knobs)
    assert "--new-knob" not in option_strings()
    help_text = build_parser(settings_type=Knobs).format_help()
    shown = re.search(r"^  --new-knob KNOBS +(.*)$", help_text, re.M)
    assert shown, help_text
    assert shown[1] == "a knob only this test declares (default: 3) [env KVBATON_NEW_KNOB]"
    conf = tmp_path / "kvbaton.toml"
    conf.write_text("new-knob = 7\n")
    for argv, env, value in [
        ([*URLS, "--new-knob", "5"], {}, 5),
        (URLS, {"KVBATON_NEW_KNOB": "6"}, 6),
        (URLS, {"KVBATON_CONFIG": str(conf)}, 7),
        (URLS, {}, 3),
    ]:
        settings = load_settings(argv, env=env, settings_type=Knobs)
        assert isinstance(settings, Knobs) and settings.new_knob == value
    with pytest.raises(ConfigError, match="KVBATON_NEW_KNOB"):
        load_settings(URLS, env={"KVBATON_NEW_KNOB": "many"}, settings_type=Knobs)
    docs = config_docs.render(Knobs)
    limits = docs[docs.index("\n## limits: ") : docs.index("\n## security: ")].splitlines()
    row = "| `--new-knob KNOBS` | `KVBATON_NEW_KNOB` | `new_knob` | `3` | a knob only this test"
    assert f"{row} declares |" in limits
    assert "new_knob" not in config_docs.render()


@pytest.mark.parametrize(
    ("settings_type", "said"),
    [
        (
            Unflagged,
            re.escape("Unflagged.bare: declare it as `bare: Annotated[TYPE, Flag(GROUP)]`"),
        ),
        (Unhelped, "Unhelped.quiet: declare it .* with its help as a docstring below it"),
        (Untaken, "Untaken.ports: a flag is str, int, float, bool"),
    ],
)
def test_a_field_declares_its_flag_its_help_and_a_type_a_flag_takes(
    settings_type: type[Settings], said: str
) -> None:
    with pytest.raises(TypeError, match=said):
        declared(settings_type)
