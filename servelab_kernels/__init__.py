"""Arithmetic kernels. Each has a torch reference twin with the same signature; kernels import
nothing else of servelab's, so the Triton versions can be swapped in by device."""
