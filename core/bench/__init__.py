"""The bench: offline runs, peers, load tests, evals, the roofline, reports and plots."""
