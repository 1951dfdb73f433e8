"""The calls plugins schedule for a step (``Trainer.call_at_step``): the loop pays one integer
comparison per step for them, however many wait."""

from __future__ import annotations

import heapq
import itertools
import sys

NEVER = sys.maxsize  # the next due step when nothing is scheduled


class ScheduledCalls:
    """``(step, order, callback)`` in a heap: calls due at the same step come out in the order they
    were scheduled; ``next_step`` is the earliest step any call waits for (:data:`NEVER`: none)."""

    def __init__(self):
        self._heap: list = []
        self._order = itertools.count()
        self.next_step = NEVER

    def add(self, step: int, callback) -> None:
        heapq.heappush(self._heap, (int(step), next(self._order), callback))
        self.next_step = self._heap[0][0]

    def take_due(self, step: int) -> list:
        """The callbacks due at ``step``, taken out (a call added while they run waits for the next boundary)."""
        due = []
        while self._heap and self._heap[0][0] <= step:
            due.append(heapq.heappop(self._heap)[2])
        self.next_step = self._heap[0][0] if self._heap else NEVER
        return due
