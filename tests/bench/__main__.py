"""`python -m tests.bench`: see tests/bench/cli.py."""

from tests.bench.cli import main

raise SystemExit(main())
