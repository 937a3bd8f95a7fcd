"""`python -m router` is the `kvbaton` command."""

from router.cli import main

raise SystemExit(main())
