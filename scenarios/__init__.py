"""Workload definitions (lengths, arrivals, prompt text) and the locust scenarios that replay them."""
