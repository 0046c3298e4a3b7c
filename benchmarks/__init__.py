"""Micro-benchmarks (pytest-benchmark) and the prepared GPU check (python -m benchmarks.gpu_check)."""
