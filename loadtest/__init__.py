"""The reliability load test (`make load`, `python -m loadtest`): run.py runs it, cli.py reads
its flags."""
