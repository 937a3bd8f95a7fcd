"""Benchmarks: router overhead, throughput, what KV reuse buys, Redis cost, profile.

`make bench` (full, writes docs/benchmarks.md) or `python -m bench --quick`.
"""
