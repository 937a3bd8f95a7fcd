"""Push mode's P coordinates: the --prefill-coordinates syntax, what P's params say, a pull P."""

from __future__ import annotations

import pytest

from router.config import ConfigError, load_settings
from router.connectors.nixl_push.coords import (
    Coordinates,
    Known,
    d_params,
    learn,
    p_params,
    parse_spec,
)
from router.connectors.select import select
from router.engines import ranks
from router.engines.pool import Instance

URLS = ["--prefill", "http://p:8100", "--decode", "http://d:8200"]


def test_spec_parses_with_options() -> None:
    url, c = parse_spec("http://10.0.0.1:8100/=prefill-0@10.0.0.1:5600,tp=2,pp=1")
    assert url == "http://10.0.0.1:8100"
    assert c == Coordinates("prefill-0", "10.0.0.1", 5600, 2, 1, "", "config")


@pytest.mark.parametrize(
    "spec",
    [
        "http://p:8100",
        "http://p:8100=@h:1",
        "http://p:8100=e@h",
        "http://p:8100=e@h:0",
        "http://p:8100=e@h:99999",
        "http://p:8100=e@h:1,tp=0",
        "http://p:8100=e@h:1,dp=2",
    ],
)
def test_bad_specs_are_config_errors(spec: str) -> None:
    with pytest.raises(ConfigError, match="--prefill-coordinates"):
        argv = [*URLS, "--kv-connector", "nixl-push", "--prefill-coordinates", spec]
        select(load_settings(argv, env={}))  # the push connector parses them


def test_learn_from_p_params_and_refuse_a_pull_p() -> None:
    known = Known()
    params = {"remote_engine_id": "e1", "remote_host": "h", "remote_port": 5600, "tp_size": 1}
    learn(known, {**params, "transfer_mode": "push"}, "probe", "p")
    assert known.coords == Coordinates("e1", "h", 5600, 1, 1, "push", "probe")
    learn(known, {**params, "remote_engine_id": "e2"}, "response", "p")  # P restarted
    assert known.coords is not None and known.coords.engine_id == "e2"
    assert known.coords.source == "probe"  # where they were first known
    learn(known, {**params, "transfer_mode": "pull"}, "response", "p")
    assert known.coords is None and "pull" in known.why_unknown
    learn(known, {"remote_engine_id": "e"}, "probe", "p")
    assert known.coords is None and "no coordinates" in known.why_unknown


def test_leg_params_are_the_push_demo_proxys() -> None:
    c = Coordinates("e1", "h", 5600, 2, 1)
    assert d_params(c, "rid", "xfer-1") == {
        "do_remote_decode": False,
        "do_remote_prefill": True,
        "remote_engine_id": "e1",
        "remote_host": "h",
        "remote_port": 5600,
        "tp_size": 2,
        "pp_size": 1,
        "remote_request_id": "rid",
        "transfer_id": "xfer-1",
    }
    assert "remote_block_ids" not in d_params(c, "rid", "x")
    p = p_params("xfer-1")
    assert p["transfer_id"] == "xfer-1" and p["do_remote_decode"] is True
    assert p["remote_engine_id"] is None and p["remote_block_ids"] is None


def test_data_parallel_sizes_configured_or_learned() -> None:
    inst = Instance("http://d:8200", "decode")
    assert ranks.size_of((), inst) == 1
    metrics = b'vllm:num_requests_running{engine="0",model_name="m"} 0.0\n' + (
        b'vllm:num_requests_running{engine="1",model_name="m"} 1.0\n'
    )
    inst.dp_size = ranks.learned_size(metrics)
    assert ranks.size_of((), inst) == 2
    assert ranks.size_of(("http://d:8200=4",), inst) == 4  # the flag wins
    assert [ranks.choose(inst, 2, -1) for _ in range(3)] == [0, 1, 0]  # spread
    assert ranks.choose(inst, 2, 1) == 1  # the conversation's rank
    assert ranks.choose(inst, 1, 0) == -1  # one rank: no header
    assert ranks.rank_of("d-engine_dp3") == 3 and ranks.rank_of("d-engine") == -1
    with pytest.raises(ConfigError, match="--data-parallel-size"):
        load_settings([*URLS, "--data-parallel-size", "http://d:8200=0"], env={})
