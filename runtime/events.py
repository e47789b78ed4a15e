"""Step events: the runtime says when each phase starts and ends, on the monotonic clock.

Power meters (edgekv.platforms) subscribe and align their samples with these
timestamps; the runtime itself knows no meter.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable


@dataclass(frozen=True)
class StepEvent:
    kind: str  # "prefill_start" | "prefill_end" | "decode_step_start" | "decode_step_end" | "groups_selected"
    t_ns: int
    info: dict = field(default_factory=dict)


Listener = Callable[[StepEvent], None]


class EventBus:
    def __init__(self):
        self._listeners: list[Listener] = []

    def subscribe(self, listener: Listener) -> None:
        self._listeners.append(listener)

    def unsubscribe(self, listener: Listener) -> None:
        self._listeners.remove(listener)

    def emit(self, kind: str, **info) -> None:
        if self._listeners:
            event = StepEvent(kind, time.monotonic_ns(), info)
            for listener in self._listeners:
                listener(event)
