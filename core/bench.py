"""`python -m core run`: placeholder replaced below."""
