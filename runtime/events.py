"""Step events: the runtime says when each phase starts and ends, on the monotonic clock.

Power meters (edgekv.platforms) subscribe and align their samples with these
timestamps; the runtime itself knows no meter.
"""
from __future__ import annotations

import json
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


class JsonLinesLog:
    """Appends step events (not the per-layer selections) to a file, one JSON object per line:
    how a meter in another process (``edgekv energy -- <command>``) aligns with this one."""

    def __init__(self, path: str):
        self.path = path

    def __call__(self, event: StepEvent) -> None:
        if event.kind == "groups_selected":
            return
        with open(self.path, "a") as f:
            f.write(json.dumps({"kind": event.kind, "t_ns": event.t_ns, "info": event.info}) + "\n")
