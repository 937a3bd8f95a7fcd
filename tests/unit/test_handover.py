"""The handover's pure parts (router/connectors/legs/handover.py): P's params as D gets them."""

from __future__ import annotations

from typing import Any

import pytest

from router.config import Settings
from router.connectors.legs import handover

P_PARAMS = {"do_remote_prefill": True, "remote_block_ids": [[1]], "first_token_ids": [42]}


@pytest.mark.parametrize(
    ("seeding", "params", "want"),
    [
        (True, P_PARAMS, P_PARAMS),
        (False, P_PARAMS, {"do_remote_prefill": True, "remote_block_ids": [[1]]}),
        (False, {"do_remote_prefill": True}, {"do_remote_prefill": True}),
        (False, None, None),
    ],
)
def test_handoff_strips_the_seed_only_when_turned_off(
    seeding: bool, params: dict[str, Any] | None, want: dict[str, Any] | None
) -> None:
    settings = Settings(prefill=("http://p",), decode=("http://d",), first_token_seeding=seeding)
    before = dict(params) if params is not None else None
    assert handover.handoff(settings, params) == want
    assert params == before  # never mutated


def test_the_parked_request_and_the_modes() -> None:
    assert handover.PARKED == {
        "do_remote_decode": False,
        "do_remote_prefill": True,
        "remote_ready": False,
    }
    assert {m.value for m in handover.Mode} == {
        "sequential",
        "seeded",
        "concurrent",
        "concurrent-seeded",
    }
