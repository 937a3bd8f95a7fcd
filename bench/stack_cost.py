"""What the stack alone costs a turn of vLLM's multi-turn benchmark, against vllm-router.

`python -m bench.stack_cost [--rounds R] [--quick] [--out FILE]` runs section 8's scenario
*vLLM's multi-turn benchmark* (bench/vllm_multiturn.py, from a fetched vLLM tree) through
three arms, each on fresh engines, the order reversed every other round: kvbaton as shipped,
vllm-router's default policy (PyPI), and the floor (bench/passthrough.py: Hypercorn +
Starlette + aiohttp passing each turn through one P and one D, no router work). It prints the
scenario's table and the router CPU per turn of each arm against the others, the figure the
router's-cost issue asks about (kvbaton <= 1.5x vllm-router), with the floor's as what any
router on this stack pays. `make bench` runs the same arms in section 8 among the others; this
runs them alone (~6 minutes for 2 rounds on a 2-CPU machine).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench import peers, vllm_multiturn
from bench.peer_venv import vllm_router
from bench.plan import FULL, QUICK
from bench.stack import LoadGen

ARMS = (peers.ARMS[0], peers.ARMS[2], peers.FLOOR_ARM)


def run(rounds: int, quick: bool) -> dict[str, Any] | None:
    """The scenario's result as section 8 keeps it; None (and one line why) without vLLM's
    benchmark or vllm-router."""
    exe = vllm_router()
    bench = vllm_multiturn.prepare(quick)
    if exe is None or bench is None:
        print("stack_cost: needs vllm-router and a vLLM tree (see above)", file=sys.stderr)
        return None
    exes = {**peers.LOCAL_EXES, peers.VLLM_ROUTER_PEER: exe}
    plan = QUICK if quick else FULL
    lg = LoadGen()
    try:
        return peers.scenario(plan, lg, peers.MULTITURN, list(ARMS), exes, bench, rounds, _say)
    finally:
        lg.close()


def _say(step: str) -> None:
    print(step, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.stack_cost", description=__doc__)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument(
        "--quick", action="store_true", help="the smaller config of `python -m bench --quick`"
    )
    p.add_argument("--out", type=Path, help="also write the result as JSON here")
    args = p.parse_args(argv)
    res = run(args.rounds, args.quick)
    if res is None:
        return 1
    print("\n".join(peers.scenario_lines(peers.MULTITURN.name, res)))
    if args.out:
        args.out.write_text(json.dumps(res, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
