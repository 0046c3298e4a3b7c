"""Data-parallel replicas: servelab engines as Ray Serve replicas behind one OpenAI ingress."""
