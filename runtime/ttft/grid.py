"""The chunk grid of a stored prefix and the dependencies between its chunks.

Chunk (t, l) is the KV of token chunk t at layer l.  Computing it means bringing chunk t's
hidden states to the input of layer l and projecting them to K/V:
  * (t, 0) needs nothing (embedding + projection: nearly free);
  * (t, l >= 1) runs layer l-1 over chunk t, whose attention reads the KV of chunks 0..t at
    layer l-1, so it needs (t, l-1) *computed* (the hidden states exist only then) and
    (t', l-1) *present* (loaded or computed) for every t' < t.
Loading a chunk needs nothing.  So computed chunks of one token chunk are always a prefix
of its layers: the top computed layer costs only its projection, never a layer whose output
nobody reads (the last layer's attention is never run for stored tokens).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

LOAD, COMPUTE = 0, 1


@dataclass(frozen=True)
class ChunkGrid:
    n_tokens: int  # the stored prefix (tokens [0, n_tokens) come from the store or are computed)
    chunk_tokens: int
    n_layers: int

    def __post_init__(self):
        if self.n_tokens < 1 or self.chunk_tokens < 1 or self.n_layers < 1:
            raise ValueError(f"empty chunk grid: {self}")

    @property
    def n_chunks(self) -> int:
        return -(-self.n_tokens // self.chunk_tokens)

    @property
    def shape(self) -> tuple[int, int]:
        return self.n_chunks, self.n_layers

    def span(self, t: int) -> tuple[int, int]:
        """Token range [start, stop) of token chunk t."""
        start = t * self.chunk_tokens
        return start, min(start + self.chunk_tokens, self.n_tokens)

    def chunks(self) -> list[tuple[int, int]]:
        return [(t, l) for t in range(self.n_chunks) for l in range(self.n_layers)]


def compute_ready(t: int, l: int, computed: np.ndarray, present: np.ndarray) -> bool:
    """May (t, l) be computed now, given bool [T, L] arrays of computed and present chunks?"""
    if l == 0:
        return True
    return bool(computed[t, l - 1]) and bool(present[:t, l - 1].all())


def check_order(grid: ChunkGrid, events: list[tuple[str, int, int]]) -> None:
    """Raise AssertionError naming the first event whose inputs did not exist when it ran.

    ``events``: ("load" | "compute", t, l) in the order they *finished*; every chunk exactly once.
    """
    computed = np.zeros(grid.shape, dtype=bool)
    present = np.zeros(grid.shape, dtype=bool)
    for kind, t, l in events:
        if present[t, l]:
            raise AssertionError(f"chunk ({t}, {l}) produced twice")
        if kind == "compute":
            if not compute_ready(t, l, computed, present):
                raise AssertionError(f"chunk ({t}, {l}) computed before its inputs existed")
            computed[t, l] = True
        elif kind != "load":
            raise AssertionError(f"unknown event kind {kind!r}")
        present[t, l] = True
    if not present.all():
        missing = [tuple(int(i) for i in c) for c in np.argwhere(~present)[:5]]
        raise AssertionError(f"chunks never produced: {missing}")
