"""Benchmarks: `python -m autoshard.bench <suite>`; workloads shared with the tests."""
