"""Developer tools, not packaged: what the Makefile and the git hooks run, and measurements
run by hand (`python -m tools.instructions`)."""
