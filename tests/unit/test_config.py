"""Settings from flags, env and a TOML file, with precedence and clear errors."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from router.config import (
    FLAGS,
    WORKER_ENV,
    ConfigError,
    Settings,
    WorkerSlot,
    build_parser,
    load_settings,
    worker_slot,
)
from router.flag import placeholder

URLS = ["--prefill", "http://p:8100", "--decode", "http://d:8200/"]


def test_defaults_and_url_normalisation() -> None:
    s = load_settings(URLS, env={})
    assert s.prefill == ("http://p:8100",)
    assert s.decode == ("http://d:8200",)
    assert s.handle_ttl == 450.0
    assert s.verify_prefix == "tokens"
    assert s.session_store == "redis"


def test_env_then_cli_precedence(tmp_path: Path) -> None:
    conf = tmp_path / "router.toml"
    conf.write_text('port = 9001\nhandle-ttl = 100\nprefill = ["http://file:1"]\n')
    env = {
        "KVBATON_PORT": "9002",
        "KVBATON_DECODE": "http://e:1, http://e:2",
        "KVBATON_STREAM_KV_PARAMS": "true",
    }
    s = load_settings(["--config", str(conf), "--port", "9003"], env=env)
    assert s.port == 9003
    assert s.handle_ttl == 100.0
    assert s.prefill == ("http://file:1",)
    assert s.decode == ("http://e:1", "http://e:2")
    assert s.stream_kv_params is True
    s2 = load_settings(["--config", str(conf)], env=env)
    assert s2.port == 9002


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        (["--decode", "http://d:1"], {}, "--prefill"),
        (["--prefill", "ftp://p:1", "--decode", "http://d:1"], {}, "http://"),
        ([*URLS, "--handle-ttl", "500", "--session-ttl", "100"], {}, "handle-ttl"),
        (URLS, {"KVBATON_PORT": "eighty"}, "KVBATON_PORT"),
        (URLS, {"KVBATON_VERIFY_PREFIX": "maybe"}, "KVBATON_VERIFY_PREFIX"),
        (URLS, {"KVBATON_STREAM_KV_PARAMS": "perhaps"}, "boolean"),
        ([*URLS, "--block-size", "-1"], {}, "block-size"),
        ([*URLS, "--workers", "0"], {}, "--workers must be >= 1"),
        ([*URLS, "--workers", "2", "--session-store", "memory"], {}, "needs --session-store redis"),
    ],
)
def test_invalid_settings_say_which_and_why(
    argv: list[str], env: dict[str, str], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        load_settings(argv, env=env)


def test_bare_host_port_is_an_http_url_as_the_demo_proxies_take_it() -> None:
    s = load_settings(["--prefill", "p1:8100", "10.0.0.2:8101/", "--decode", "d:8200"], env={})
    assert s.prefill == ("http://p1:8100", "http://10.0.0.2:8101")
    assert s.decode == ("http://d:8200",)
    s = load_settings([], env={"KVBATON_PREFILL": "p:1, https://q:2", "KVBATON_DECODE": "d:1"})
    assert s.prefill == ("http://p:1", "https://q:2")


def test_repeated_prefill_and_decode_add_up_as_vllm_router_writes_them() -> None:
    """`--prefill A --prefill B` is both (the last one alone used to win, silently); a list
    after one flag, both forms mixed, and the environment's list keep working."""
    s = load_settings(["--prefill", "p1:1", "--prefill", "p2:1", "--decode", "d:1"], env={})
    assert s.prefill == ("http://p1:1", "http://p2:1")
    s = load_settings(["--prefill", "p1:1", "p2:1", "--decode", "d1:1", "--decode", "d2:1"], {})
    assert (s.prefill, s.decode) == (("http://p1:1", "http://p2:1"), ("http://d1:1", "http://d2:1"))
    s = load_settings(["--prefill", "p1:1", "p2:1", "--prefill", "p3:1", "--decode", "d:1"], {})
    assert s.prefill == ("http://p1:1", "http://p2:1", "http://p3:1")
    env = {"KVBATON_PREFILL": "p1:1 p2:1", "KVBATON_DECODE": "d:1"}
    assert load_settings([], env=env).prefill == ("http://p1:1", "http://p2:1")
    # The command line still replaces the environment's list, not adds to it.
    assert load_settings(["--prefill", "q:1", "--prefill", "r:1"], env=env).prefill == (
        "http://q:1",
        "http://r:1",
    )


def test_admin_api_key_reads_the_demo_proxies_variable_below_its_own() -> None:
    assert load_settings(URLS, env={"ADMIN_API_KEY": "seed"}).admin_api_key == "seed"
    both = {"ADMIN_API_KEY": "seed", "KVBATON_ADMIN_API_KEY": "ours"}
    assert load_settings(URLS, env=both).admin_api_key == "ours"
    assert load_settings([*URLS, "--admin-api-key", "cli"], env=both).admin_api_key == "cli"
    assert load_settings(URLS, env={}).admin_api_key == ""


def test_the_two_admin_keys_say_how_they_differ() -> None:
    """--admin-key guards /admin/ (Bearer); --admin-api-key is the demo proxies' X-API-Key for
    POST /instances/add alone, falling back to --admin-key: not duplicates, and --help says so."""
    helps = {f.name: f.help for f in FLAGS}
    assert "/admin/" in helps["admin_key"] and "Authorization: Bearer" in helps["admin_key"]
    assert "POST /instances/add" in helps["admin_key"]  # the fallback, said on both sides
    assert "X-API-Key" in helps["admin_api_key"] and "POST /instances/add" in helps["admin_api_key"]
    assert "opens nothing under /admin/" in helps["admin_api_key"]
    s = load_settings([*URLS, "--admin-key", "a" * 16, "--admin-api-key", "b" * 16], env={})
    assert (s.admin_key, s.admin_api_key) == ("a" * 16, "b" * 16)


def test_unknown_and_broken_config_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("colour = 'blue'\n")
    with pytest.raises(ConfigError, match="unknown setting 'colour'"):
        load_settings([*URLS, "--config", str(bad)], env={})
    broken = tmp_path / "broken.toml"
    broken.write_text("port = = 1\n")
    with pytest.raises(ConfigError, match=r"broken\.toml"):
        load_settings([*URLS, "--config", str(broken)], env={})
    with pytest.raises(ConfigError, match=r"missing\.toml"):
        load_settings([*URLS, "--config", str(tmp_path / "missing.toml")], env={})


def test_every_setting_has_a_flag_and_help() -> None:
    names = {f.name for f in FLAGS}
    assert names == set(Settings.__struct_fields__)
    help_text = build_parser().format_help()
    for flag in FLAGS:
        assert "--" + flag.name.replace("_", "-") in help_text
        assert "KVBATON_" + flag.name.upper() in help_text.replace("\n", "").replace(" ", "")


@pytest.mark.parametrize(
    ("flag", "shown"),
    [
        ("--prefill", "URL [URL ...]"),
        ("--redis-url", "URL"),
        ("--data-parallel-size", "URL=N"),
        ("--prefill-coordinates", "URL=ENGINE_ID@SIDE_HOST:SIDE_PORT[,tp=N][,pp=N]"),
        ("--kv-events", "ENGINE_URL=ZMQ_ENDPOINT[,REPLAY]"),
        ("--moriio-register", "tcp://HOST:PORT"),
        ("--handle-ttl", "SECONDS"),
        ("--pin-high-water", "FRACTION"),
        ("--max-body-bytes", "BYTES"),
        ("--session-secret", "SECRET[,SECRET...]"),
        ("--config", "FILE"),
    ],
)
def test_help_shows_what_each_flag_takes(flag: str, shown: str) -> None:
    line = rf"^  {flag} {re.escape(shown)}(  |$)"
    assert re.search(line, build_parser().format_help(), re.MULTILINE), flag


def test_no_placeholder_is_a_flag_name_or_a_guess() -> None:
    """argparse's default placeholder is the setting's name in capitals (REDIS_URL), which
    says nothing; "URL=ENDPOINT" was shown for flags that take neither."""
    for flag in FLAGS:
        if flag.kind is bool or flag.choices:
            continue
        shown = placeholder(flag)
        assert "_" not in flag.name or shown != flag.name.upper(), flag.name
        assert flag.kind is not str or flag.metavar, f"{flag.name}: say what it takes (metavar)"
    assert "URL=ENDPOINT" not in build_parser().format_help()


def test_worker_slot_round_trip_and_garbage() -> None:
    slot = WorkerSlot(index=1, listen_fd=5, ready_fd=7)
    assert worker_slot({WORKER_ENV: slot.encode()}) == slot
    assert worker_slot({}) is None
    with pytest.raises(ConfigError, match=WORKER_ENV):
        worker_slot({WORKER_ENV: "1,five,7"})
