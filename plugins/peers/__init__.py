"""Benchmark peers: other systems `run` and `compare` measure on the same workload."""
