"""Developer tools the Makefile and the git hooks run (not packaged)."""
