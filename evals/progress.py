"""Progress for long measuring runs: one bar over the cells (with ETA), one inside the running cell.

The inner bar follows the engine's step events (a prompt prefilled, a decode step done), so a
cell that runs for minutes still moves; ``quiet`` silences both.  Bars go to stderr, so the
tables and JSON a command prints on stdout stay clean.  When stderr is a file or a pipe (a log,
a remote machine's captured output) the inner bar is left out, since its cursor moves garble a log,
and the outer one is redrawn at most every ``LOG_INTERVAL_S`` seconds, so the log keeps its ETA.
"""
from __future__ import annotations

import sys
from contextlib import contextmanager

from tqdm import tqdm


LOG_INTERVAL_S = 30.0


class Progress:
    def __init__(self, cells: int, desc: str = "cells", quiet: bool = False):
        self.quiet = quiet
        self._terminal = sys.stderr.isatty()
        self._cells = tqdm(total=cells, desc=desc, unit="cell", file=sys.stderr, disable=quiet, dynamic_ncols=True,
                           mininterval=0.1 if self._terminal else LOG_INTERVAL_S)

    @contextmanager
    def cell(self, label: str, engine_steps: int | None = None):
        """Yields an engine event listener that advances the cell's bar per prefill and decode step."""
        bar = tqdm(total=engine_steps, desc=f"  {label}", unit="step", file=sys.stderr,
                   disable=self.quiet or not self._terminal, leave=False, dynamic_ncols=True)

        def on_event(event) -> None:
            if event.kind in ("prefill_end", "decode_step_end"):
                bar.update()

        try:
            yield on_event
        finally:
            bar.close()
            self._cells.update()

    def write(self, line: str) -> None:
        """A result line that stays above the bars (suppressed when quiet)."""
        if not self.quiet:
            tqdm.write(line, file=sys.stderr)

    def close(self) -> None:
        self._cells.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
