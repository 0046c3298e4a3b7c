"""The engine: types, contracts, plugin registry, the step loop, the output processor."""
