"""`python -m bench.load`: the reliability load test (see bench/load/run.py)."""

from bench.load.cli import main

raise SystemExit(main())
