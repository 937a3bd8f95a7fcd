"""Command line of the load test: plan from flags, a private stack, a summary table."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from loadtest.run import Plan, run

QUICK = {"conversations": 40, "turns": 3, "concurrency": 40}


def parse(argv: Sequence[str]) -> tuple[Plan, str | None]:
    defaults = Plan()
    parser = argparse.ArgumentParser(
        prog="python -m loadtest",
        description="Concurrent multi-turn conversations through kvbaton (2 P, 2 D simulators, "
        "Redis, loopback only) with faults injected mid-run; every answer is compared with a "
        "from-scratch reference instance. Exits 1 unless failed, handles used twice and wrong "
        "answers are all 0.",
    )
    parser.add_argument("--conversations", type=int, default=defaults.conversations)
    parser.add_argument("--turns", type=int, default=defaults.turns)
    parser.add_argument("--concurrency", type=int, default=None, help="default: --conversations")
    parser.add_argument("--max-tokens", type=int, default=defaults.max_tokens)
    parser.add_argument("--no-faults", action="store_true", help="no faults injected")
    parser.add_argument("--time-limit", type=float, default=defaults.time_limit, help="seconds")
    parser.add_argument("--quick", action="store_true", help="40 conversations x 3 turns")
    parser.add_argument("--json", metavar="PATH", help="also write the result as JSON")
    args = parser.parse_args(list(argv))
    sizes = (
        dict(QUICK) if args.quick else {"conversations": args.conversations, "turns": args.turns}
    )
    sizes["concurrency"] = args.concurrency or sizes["conversations"]
    plan = Plan(
        **sizes,
        max_tokens=args.max_tokens,
        faults=not args.no_faults,
        time_limit=args.time_limit,
    )
    return plan, args.json


def main(argv: Sequence[str] | None = None) -> int:
    plan, json_path = parse(sys.argv[1:] if argv is None else argv)
    print(
        f"starting: {plan.conversations} conversations x {plan.turns} turns, "
        f"faults {'on' if plan.faults else 'off'}, limit {plan.time_limit:.0f}s",
        flush=True,
    )
    result = run(plan)
    print(result.table())
    if json_path:
        with open(json_path, "w") as fh:
            json.dump(result.as_dict(), fh, indent=2)
    ok = result.failed == 0 and result.used_twice == 0 and result.wrong == 0 and result.complete
    return 0 if ok else 1
