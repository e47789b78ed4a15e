"""The decode step's helper thread on a CPU (runtime/native/ekv_aside.c): the core a disk policy's step leaves to the
reads is idle most of the step, so the native kernels hand it work as units (``fn(ctx, unit, worker)``).

- ``post``: a job the helper runs alone while the caller goes on (the next layer's K_lr scores, runtime/selector.py);
  ``done``/``wait`` by its ticket.
- ``share``: a job the caller and the helper take units of until none is left (a correction's scores, a part of a
  sequence a unit, so a batch of one is shared too; the records' attention, runtime/record_attention.py, a sequence's
  KV head a unit).

A thread of C, so it never takes Python's GIL.  A job's context is a buffer the kernel fills (``ekv_*_job``); what it
points into stays referenced here until its ticket is known done.
"""
from __future__ import annotations

import ctypes
import functools
import os
import threading
import weakref
from collections import deque

import numpy as np

from .kernels import Backend, resolve_backend, unit_function
from .native_build import address


# how long ``full``'s helper spins out of work when the model's layers share it (weights 'ggml'): longer than the
# Python between two of a layer's calls; SmolLM2 8K, batch 1: 1.15x the step of a sleeping helper and torch's two
# threads
SPIN_US = 300


def cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


class AsideThread:
    """One helper thread; ``open`` gives None where it would only take turns with the caller (one core), where the
    backend has no native kernels to hand it, or where it cannot start.  Only the caller's thread posts and shares;
    another may wait for a posted job (an I/O thread taking picks)."""

    def __init__(self, lib: ctypes.CDLL, handle: int, spins: bool = False):
        self._lib, self._handle = lib, handle
        self.spins = spins  # a job shared with it costs no wake-up: small ones are worth sharing too
        self._kept: deque[tuple[int, tuple]] = deque()  # (ticket, what a posted job points into), oldest first
        self._forgetting = threading.Lock()
        self._share_at = unit_function(lib, "ekv_aside_share")
        self._post_chain_at = unit_function(lib, "ekv_aside_post_chain")
        self._closed = weakref.finalize(self, lib.ekv_aside_close, handle)  # at close, collection or exit

    @classmethod
    def open(cls, spin_us: int = 0, backend: Backend | None = None) -> "AsideThread | None":
        """``spin_us``: how long the helper, out of work, and a caller, waiting for its share, spin before they
        sleep (ekv_aside.c): a core with nothing else to run (``full``'s step) hands each small job to the helper
        without a wake-up; 0 where the core is the reads' too.  ``backend``: the policy's (runtime/kernels.py; None:
        the CPU's)."""
        lib = (backend or resolve_backend("cpu")).lib("aside") if cores() > 1 else None
        handle = lib.ekv_aside_open() if lib is not None else None
        if handle and spin_us:
            lib.ekv_aside_spin(handle, spin_us)
        return cls(lib, handle, spin_us > 0) if handle else None

    def post(self, fn: int, job: np.ndarray, units: int, keep: tuple = ()) -> int:
        """``fn``'s units 0 .. units-1 on the helper, over the job buffer ``job`` (and ``keep``, what it points into,
        alive until done); its ticket.  Once closed, the caller runs them now (as the helper would)."""
        if not self._closed.alive:
            run_units(fn, job, units, worker=1)
            return 0
        ticket = self._lib.ekv_aside_post(self._handle, fn, address(job), units)
        self._kept.append((ticket, (job, *keep)))
        return ticket

    def post_chain(self, jobs: list[tuple[int, np.ndarray, int]], keep: tuple = ()) -> int:
        """Each (fn, job, units) of ``jobs`` posted in order in one call (``post`` each); the last one's ticket."""
        if not self._closed.alive:
            for fn, job, units in jobs:
                run_units(fn, job, units, worker=1)
            return 0
        n = len(jobs)
        fns, units = (ctypes.c_void_p * n)(*(job[0] for job in jobs)), (ctypes.c_int64 * n)(*(job[2] for job in jobs))
        ctxs = (ctypes.c_void_p * n)(*(address(job[1]) for job in jobs))
        ticket = self._lib.ekv_aside_post_chain(self._handle, fns, ctxs, units, n)
        self._kept.append((ticket, (*(job[1] for job in jobs), *keep)))
        return ticket

    def done(self, ticket: int) -> bool:
        if not self._closed.alive or self._lib.ekv_aside_done(self._handle, ticket):
            self._forget(ticket)
            return True
        return False

    def wait(self, ticket: int) -> None:
        if self._closed.alive:  # a closed thread finished every job posted
            self._lib.ekv_aside_wait(self._handle, ticket)
        self._forget(ticket)

    def share(self, fn: int, job: np.ndarray, units: int) -> None:
        """``fn``'s units 0 .. units-1 by the caller and the helper; returns once all are done (once closed, by the
        caller alone)."""
        if not self._closed.alive:
            run_units(fn, job, units, worker=0)
            return
        self._lib.ekv_aside_share(self._handle, fn, address(job), units)

    def native_share(self) -> tuple[int, int] | None:
        """(``ekv_aside_share``'s address, this thread's handle) for a kernel that shares its jobs from C, as ``share``
        does; None once closed (the kernel then runs every unit itself)."""
        return (self._share_at, self._handle) if self._closed.alive else None

    def native_post(self) -> tuple[int, int] | None:
        """(``ekv_aside_post_chain``'s address, this thread's handle) for a kernel that posts its jobs from C; then
        ``posted`` keeps what they point into.  None once closed (the caller posts through ``post_chain``)."""
        return (self._post_chain_at, self._handle) if self._closed.alive else None

    def posted(self, ticket: int, keep: tuple) -> None:
        """A chain posted from C (``native_post``) with ``ticket``: ``keep`` (what its jobs point into) lives until it
        is done."""
        self._kept.append((ticket, keep))

    def _forget(self, ticket: int) -> None:
        """Jobs up to ``ticket`` are done: what they pointed into may go (one thread at a time: two popping at once
        could drop a job still running)."""
        with self._forgetting:
            while self._kept and self._kept[0][0] <= ticket:
                self._kept.popleft()

    def close(self) -> None:
        """The jobs posted finish; the thread ends."""
        self._closed()
        self._kept.clear()


class PostOrShare:
    """Whether a step posts the next layer's scores to the helper or shares them with it, by which kept steps shorter.

    Posted, the compute thread goes on with this layer's QKV and attention while the helper scores, and takes the
    picks after that attention: their reads start then.  Shared, the compute thread scores about half the parts of the
    sequences beside the helper and the reads start before this layer's QKV.  Which is faster depends on what the step
    waits for: SmolLM2 8K, the deployed configuration, posting is 1.17x / 1.28x no helper at batch 1 / 4 with the KV on
    tmpfs (sharing 1.03x / 1.27x), 1.08x at batch 1 from this machine's disk (sharing 1.04x) and 1.02x at batch 4
    there, where sharing is 1.28x: the step waits on ~3,400 read requests, and posting starts them later.  So both
    are timed: ``TRIAL_STEPS`` steps of each at the start of every ``CYCLE_STEPS``, the rest of the cycle the one
    whose median step was shorter."""

    TRIAL_STEPS = 4
    CYCLE_STEPS = 64

    def __init__(self, fixed: bool | None = None):
        """``fixed``: always post (True) or share (False), untimed (a bench comparing them); None: timed."""
        self._step = 0
        self._trial: dict[bool, list[float]] = {True: [], False: []}
        self._chosen = True
        self.fixed = fixed

    @property
    def posting(self) -> bool:
        """Whether this step posts."""
        if self.fixed is not None:
            return self.fixed
        at = self._step % self.CYCLE_STEPS
        return at < self.TRIAL_STEPS if at < 2 * self.TRIAL_STEPS else self._chosen

    def took(self, step_s: float) -> None:
        """The step just ended took ``step_s``."""
        at = self._step % self.CYCLE_STEPS
        if self.fixed is None and at < 2 * self.TRIAL_STEPS:
            self._trial[at < self.TRIAL_STEPS].append(step_s)
            if at == 2 * self.TRIAL_STEPS - 1:
                self._chosen = float(np.median(self._trial[True])) <= float(np.median(self._trial[False]))
                self._trial = {True: [], False: []}
        self._step += 1


@functools.cache
def _unit_call(fn: int):
    """A callable for the unit function at ``fn``, made once (each select calls it with no helper)."""
    return ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int)(fn)


def run_units(fn: int, job: np.ndarray, units: int, worker: int = 0) -> None:
    """A job's units on the caller's thread (with no helper thread)."""
    call = _unit_call(fn)
    for unit in range(units):
        call(address(job), unit, worker)
