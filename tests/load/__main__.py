"""`python -m tests.load`: the reliability load test (see tests/load/run.py)."""

from tests.load.cli import main

raise SystemExit(main())
