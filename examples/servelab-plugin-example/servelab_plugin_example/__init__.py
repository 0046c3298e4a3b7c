"""A third-party servelab plugin package: a scheduler, a cache allocator and an attention backend.

Everything comes from `core.api`, servelab's public surface; the entry point in pyproject.toml
is the whole integration.
"""

from core.api import hookimpl

from .dense_attention import DenseAttention
from .freelist import FreeListAllocator
from .sjf import ShortestJobFirstScheduler, SJFConfig

__all__ = ["DenseAttention", "FreeListAllocator", "SJFConfig", "ShortestJobFirstScheduler"]


@hookimpl
def servelab_schedulers():
    return {"sjf": ShortestJobFirstScheduler}


@hookimpl
def servelab_cache_allocators():
    return {"freelist": FreeListAllocator}


@hookimpl
def servelab_attention_backends():
    return {"dense": DenseAttention}
