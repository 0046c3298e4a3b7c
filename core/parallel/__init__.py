"""Tensor parallelism: the model split over ranks, and the ranks that run it."""
