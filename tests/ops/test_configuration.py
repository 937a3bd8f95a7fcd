"""docs/configuration.md is generated from FLAGS and kept in sync; every flag works from the
environment and from a TOML file (precedence itself: tests/unit/test_config.py)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from router import config_docs
from router.config import FLAGS, Flag, Settings, load_settings
from router.errors import ConfigError

DEFAULTS = Settings(prefill=(), decode=())


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
