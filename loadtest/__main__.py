"""`python -m loadtest`: the reliability load test (see loadtest/run.py)."""

from loadtest.cli import main

raise SystemExit(main())
