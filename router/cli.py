"""The `kvbaton` command: `serve` (the router), `sim` (the engine simulator), `demo`,
`session show`."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from router import kvbaton_version

USAGE = """usage: kvbaton {serve,sim,demo,session} [options]
       kvbaton --version

  serve   run the router (kvbaton serve --help)
  sim     run a vLLM-compatible engine simulator (kvbaton sim --help)
  demo    run a local GPU-free stack and a scripted conversation (kvbaton demo --help)
  session look up a conversation's session in Redis (kvbaton session show --help)
"""


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:  # a usage error, as argparse makes one: usage on stderr, status 2
        print(USAGE, file=sys.stderr, end="")
        return 2
    if args[0] in ("-h", "--help"):
        print(USAGE, end="")
        return 0
    if args[0] == "--version":
        print(f"kvbaton {kvbaton_version()}")
        return 0
    command, rest = args[0], args[1:]
    if command == "sim":
        # The simulator is a separate program that shares no code with the router.
        from vllm_sim.cli import main as sim_main

        return sim_main(rest)
    if command == "serve":
        from router.http.server import serve_main

        return serve_main(rest)
    if command == "demo":
        from router.lifecycle.demo import demo_main

        return demo_main(rest)
    if command == "session":
        from router.session_show import main as session_main

        return session_main(rest)
    print(f"kvbaton: unknown command {command!r}\n{USAGE}", file=sys.stderr, end="")
    return 2
