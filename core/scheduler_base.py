"""Queue bookkeeping every scheduler needs; the policy (`schedule`) is each plugin's own."""

from __future__ import annotations

from core.config import SchedulerConfig
from core.interfaces import CacheAllocator
from core.types import SchedulerOutput, Sequence


class QueueScheduler:
    """Waiting and running lists, admission and retirement. Subclasses implement `schedule`."""

    def __init__(self, config: SchedulerConfig, allocator: CacheAllocator) -> None:
        self.config = config
        self.allocator = allocator
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def finish(self, seq: Sequence) -> None:
        """A sequence ended (stop, length or abort): drop it wherever it is and free its KV."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.allocator.free(seq)

    def schedule(self) -> SchedulerOutput:
        raise NotImplementedError
