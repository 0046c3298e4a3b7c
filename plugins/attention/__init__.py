"""Attention backends: the KV layout and the attention arithmetic over block tables."""
