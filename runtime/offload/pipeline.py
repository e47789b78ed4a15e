"""The disk policies' decode step, layer by layer: select + fetch a layer ahead (``prefetch``) -> attend (``attend``)
-> append and flush (``end_step``).  Each layer's fetch is one ``LayerFetch``, picked -> planned -> reading -> landed;
its picks are taken in one place (``_take``), by the compute thread or, on a CPU with the native planner, by an I/O
thread the moment the helper thread has made them.  The stages apart from the step's order live beside it: the
window (window.py), the reads' threads (io.py), the picks' attention (attention.py), and the stages built only when
configured, correction (correction.py) and re-clustering (recluster.py)."""
from __future__ import annotations

import time

import numpy as np
import torch

from ..aside import AsideThread, PostOrShare
from ..config import RuntimeConfig
from ..disk_store import DiskKVStore
from ..errors import DiskError, RowsFailed
from ..fetch_plan import NativePlanner, planner_for
from ..kernels import Backend, resolve_backend
from ..kv_policy import KVPolicy
from ..model import DecoderModel
from ..selector import Selector
from ..slot_memory import slot_memory
from ..slots import Slots
from .attention import picked_attention
from .correction import Correction
from .fetch import HostPicks, LayerFetch, PicksFromBefore, PrefixOwners, ScoredPicks, Stage, launch_picks
from .io import ReadIO
from .recluster import Recluster
from .window import Window


class OffloadedKV(KVPolicy):
    """KV on disk, a selected subset in memory: the policy behind ``kvswap``, ``token``, ``flexgen`` and
    ``hillinfer``, which differ in their selector and config.  Records keep the disk's format (``kv_record_dtype``) in
    the reuse slots too; attention decodes only the groups it selected, so quantized records shrink the reads and the
    slots while the sinks and window stay exact."""

    def __init__(self, model: DecoderModel, batch: int, cfg: RuntimeConfig, store: DiskKVStore, selector: Selector,
                 slots: Slots, predict: bool = True, placer=None, on_select=None, backend: Backend | None = None):
        """``cfg``: the policy's effective config.  ``predict``: the selector gets the next layer's predicted query
        (flexgen's needs none).  ``placer``: a cluster.CoactivationLayout placing a prompt's groups on the KV paths
        (None: striped).  ``on_select(layer, groups [B, M], valid [B, M])``: each layer's picks as it attends.
        ``backend``: the kernels (runtime/kernels.py; None: the device's)."""
        super().__init__(model, batch, cfg.max_context)
        dims, cpu = model.dims, model.device.type == "cpu"
        backend = backend or resolve_backend(model.device)
        self.store, self.layout, self.selector, self.slots = store, store.layout, selector, slots
        self.G, self.picked_groups = store.layout.group_tokens, cfg.picked_groups
        self.predict, self.on_select = predict, on_select
        self.window = Window(model, batch, cfg, self.G, backend)
        # on a GPU the slots are device memory and only misses cross the bus, or pinned host memory it reads in place
        self.slot_memory = slot_memory(slots.n_buffers(dims.n_layers), batch, slots.capacity, self.layout,
                                       model.device, batch * self.picked_groups, cfg.io.slot_memory)
        self.attention = picked_attention(backend, model, self.layout, self.slot_memory, slots, self.window)
        self.planner = planner_for(backend, slots, self.slot_memory, store, self.bytes_read)
        self.takes_on_io = cpu and isinstance(self.planner, NativePlanner)  # picks still being made: _take's thread
        reads_cap = cfg.correction_slots if predict and selector.reads_ahead else 0
        self.io = ReadIO(store, self.slot_memory, self.read_time, cfg.io.read_deadline_s, bool(reads_cap))
        self.prefix_owners = PrefixOwners(batch)
        self.correction = Correction(dims.n_layers, batch, reads_cap, cfg.predictor, self.planner, self.io, slots,
                                     lambda layer, q: self._launch(layer, q).result(), self.prefix_owners.of) \
            if reads_cap else None
        self.recluster = Recluster(placer, store, slots, self.slot_memory, dims.n_layers, batch,
                                   cfg.placement.recluster_steps, self.G, self.picked_groups, cfg.sink_groups,
                                   cfg.window_groups) if placer is not None else None
        self.prompt_queries = self.recluster.prompt_queries if self.recluster is not None else 0
        # on a CPU a helper thread makes the next layer's scores and shares a correction's and the records' attention
        # (runtime/aside.py): the core the step leaves to the reads is idle most of the step
        self.aside = AsideThread.open(backend=backend)
        self.lend_aside(self.aside)
        self.post_or_share = PostOrShare() if self.aside is not None else None
        self._step_started = None  # perf_counter at the step's first prefetch: the steps the PostOrShare choice times
        self._active = np.ones(batch, dtype=bool)
        self._fetches: dict[int, LayerFetch] = {}  # layer -> its fetch this step, launched and not yet attended

    @property
    def resident_bytes(self) -> int:
        return (self.slot_memory.nbytes + self.window.nbytes + self.selector.resident_bytes + self.store.table_bytes
                + self.slots.nbytes)

    def start_sequence(self, seq):
        super().start_sequence(seq)
        self.store.open_sequence(seq)
        self.slots.reset(seq)
        self.window.start(seq)
        self.prefix_owners.reset(seq)
        if self.correction is not None:
            self.correction.reset(seq)
        if self.recluster is not None:
            self.recluster.start_sequence(seq)

    def share_prefix(self, seq, owner, n_groups):
        """``seq``'s first ``n_groups`` groups are ``owner``'s records, in one reuse pool: read once, hit by both."""
        self.store.share_prefix(seq, owner, n_groups)
        self.prefix_owners.share(seq, owner, n_groups)
        self.slots.share([owner, seq])  # joins the pool of the owner's other borrowers too

    def observe_prompt(self, layer, seq, q):
        if self.recluster is not None:  # the one stage that asks for them (prompt_queries)
            self.recluster.observe(layer, q)

    def store_prompt(self, layer, seq, k, v):
        tokens = k.shape[1] // self.G * self.G
        if self.recluster is not None:
            self.recluster.lay_out(layer, seq, k, tokens // self.G, borrows=bool(self.prefix_owners.shared_groups[seq]))
        self.store.write_groups(seq, layer, 0, self.layout.pack(k[:, :tokens], v[:, :tokens]))
        self.selector.append(layer, seq, 0, k[:, :tokens])
        self.window.keep_prompt(layer, seq, k, v)

    def end_prefill(self):
        self.selector.end_prefill()

    def lend_aside(self, aside: AsideThread | None) -> None:
        """Lend the helper thread to what computes beside it (the scores, the records' attention); None withdraws it."""
        self.selector.aside = aside
        self.model.lend_aside(aside, self)
        self.attention.lend_aside(aside)

    # ---- the decode step: select + fetch -> attend -> append -> flush ------------------------------

    def prefetch(self, layer, x, rope, active):
        """Select + fetch, a layer ahead: the picks from the layer's predicted query (or its corrected picks of the step
        before), read on an I/O thread while the layer before computes.  On a GPU they reach the host in one copy
        queued behind the selection, taken when the layer before attends: its QKV is queued, the device kept fed."""
        self._active = active
        if layer == 0:
            self._step_started = time.perf_counter()
        if not self.selector.reads_ahead:
            return
        started = time.perf_counter()
        before = self.correction.before(layer) if self.correction is not None else None
        if before is not None and before[0][active].all():
            picks = HostPicks(torch.from_numpy(before[1]), active)
        else:
            picks = self._launch(layer, self.model.query(layer, x, rope) if self.predict else None,
                                 post=self.post_or_share is None or self.post_or_share.posting)
            if before is not None:
                picks = PicksFromBefore(picks, *before)
        fetch = self._fetches[layer] = LayerFetch(layer, picks, active)
        self.select_s += time.perf_counter() - started
        if self.takes_on_io and not picks.ready():  # on an I/O thread, once made
            fetch.stage, fetch.future = Stage.READING, self.io.submit(self._take_and_read, fetch, self._gate(layer))
        elif self.model.device.type != "cuda":  # no queue to keep fed: the reads start once the picks are made
            self._take_made(wait_upto=-1)

    def take_picks(self) -> None:
        """The launched picks taken in layer order and their reads submitted (a hybrid model's local layers too)."""
        self._take_made(wait_upto=None)

    def _take_made(self, wait_upto: int | None) -> None:
        """``take_picks``, waiting only for the layers up to ``wait_upto`` (None: all); later ones taken if made."""
        for fetch in [f for f in self._fetches.values() if f.stage is Stage.PICKED]:
            if wait_upto is not None and fetch.layer > wait_upto and not fetch.picks.ready():
                return
            started = time.perf_counter()
            self._take(fetch)
            fetch.stage = Stage.PLANNED
            self.select_s += time.perf_counter() - started
            fetch.stage, fetch.future = Stage.READING, self.io.submit(self._read, fetch, self._gate(fetch.layer))

    def _take(self, fetch: LayerFetch) -> None:
        """The one place picks are taken: on the host, kept for re-clustering, slots assigned and the misses' reads
        planned (the planner's lock: the compute thread and an I/O thread both plan)."""
        fetch.groups, fetch.valid = fetch.picks.result()
        if self.recluster is not None:
            self.recluster.keep(fetch.layer, fetch.groups, fetch.valid, self.prefix_owners.of, fetch.active)
        fetch.plan = self.planner.plan(fetch.layer, fetch.groups, fetch.valid,
                                       self.prefix_owners.where_shared(fetch.groups))

    def _read(self, fetch: LayerFetch, gate) -> None:
        self.io.read(fetch.layer, self.slots.buffer_index(fetch.layer), fetch.plan.misses, fetch.plan.reads, gate)

    def _take_and_read(self, fetch: LayerFetch, gate) -> None:
        """On an I/O thread: the picks once made, taken, and their misses read."""
        self._take(fetch)
        self._read(fetch, gate)

    def _gate(self, layer: int):
        """What ``layer``'s reads wait for first: the correction of the layer before, when it corrects."""
        return None if self.correction is None else self.correction.gate(layer, (layer - 1) in self._fetches,
                                                                         self._active)

    def _launch(self, layer: int, q: torch.Tensor | None, post: bool = False) -> HostPicks | ScoredPicks:
        return launch_picks(self.selector, layer, q, self.window.outside(), self.window.sink_groups, self._active, post)

    def attend(self, layer, q, k, v):
        """Attention over the fetched picks, the sinks and the window, the step's own K/V in their ring slot first (a
        token attends to itself).  The next layer's picks are taken before it on a GPU (its QKV is queued, and their
        reads start while this layer's land); on a CPU once made, those scored beside this attention after it."""
        if self.model.device.type != "cpu":
            self.take_picks()  # this layer's (if not yet) and the next one's
            return self._attend(layer, q, k, v)
        self._take_made(wait_upto=layer)
        out = self._attend(layer, q, k, v)
        self.take_picks()  # the next layer's: their reads overlap this layer's MLP
        return out

    def _attend(self, layer, q, k, v):
        if not self.selector.reads_ahead:  # picks from the layer's own query, read now
            started = time.perf_counter()
            self._fetches[layer] = LayerFetch(layer, self._launch(layer, q), self._active)
            self.select_s += time.perf_counter() - started
            self._take_made(wait_upto=layer)
        write_at, resident = self.window.step_tensors(q.device)
        self.window.write(layer, k, v, write_at)
        corrected = self.correction.rescore(layer, q, self._active) if self.correction is not None else None
        try:
            fetch = self._landed(layer)
            if corrected is None:
                return self.attention(layer, q, fetch.plan.slots, fetch.valid, resident)
            return self.correction.attend(layer, q, corrected, self.attention, resident)
        finally:
            if self.correction is not None:  # the next layer's read may start
                self.correction.open_gate(layer)

    def _landed(self, layer: int) -> LayerFetch:
        """The layer's fetch once its reads landed; its picks are seen here, in layer order, whoever took them."""
        fetch = self._fetches.pop(layer)
        start = time.perf_counter()
        self.io.wait(layer, fetch.future)
        self.io_stall_s += time.perf_counter() - start
        fetch.stage = Stage.LANDED
        if self.on_select is not None:
            self.on_select(layer, fetch.groups, fetch.valid)
        if self.correction is not None:
            self.correction.landed(fetch.groups, fetch.valid, fetch.plan.slots)
        return fetch

    def end_step(self, active):
        """Append: the step's tokens join the window.  Flush: a window group now full goes to disk and into K_lr, every
        layer's record packed at once and every layer's keys projected at once.  Then re-clustering, where due.  A
        group the KV disk cannot take (full, failing) ends its sequence alone: each sequence writes its own files, so
        the others' groups flush all the same, and once the step is whole ``RowsFailed`` names the failed ones (their
        group is dropped and their window emptied: they must leave before the next step)."""
        super().end_step(active)
        if self.correction is not None:
            self.correction.end_step()
        failed: dict[int, DiskError] = {}
        for seq, span, kv in self.window.end_step(active):
            group = int(self.window.n_groups[seq])
            records = self.layout.pack(*(kv[:, i].transpose(0, 1).flatten(1, 2) for i in (0, 1)))  # [L, stride]
            try:
                self.store.write_layers(seq, group, records[:, None])
            except DiskError as exc:  # every write of the flush has ended: none lands in the files later
                failed[seq] = exc
                self.window.start(seq)  # emptied: no later step flushes the group again or writes past its ring
                continue
            self.selector.append_layers(seq, group * self.G, self.window.rolling[:, seq, 0, :, span])
            self.window.flushed(seq, span)
        if self.recluster is not None:
            laid_out = active.copy()
            laid_out[list(failed)] = False  # a failed sequence is not laid out again: its disk refuses writes
            self.recluster.end_step(laid_out, self.window.n_groups)
        if self.post_or_share is not None and self._step_started is not None:  # from its first prefetch: no pause
            self.post_or_share.took(time.perf_counter() - self._step_started)  # between steps counts
        if failed:
            raise RowsFailed(failed)

    # ---- stats and release ------------------------------------------------------------------------

    def reuse_counts(self):
        return self.slots.hits.copy(), self.slots.lookups.copy()

    def stats(self, seq):
        return {**super().stats(seq), **self.store.read_stats(), "scorer_fallback": None,
                **(self.correction.stats(seq) if self.correction is not None else {}),
                "kv_bytes_copied": self.slot_memory.bytes_copied, **self.selector.stats()}

    def fitted_adapter(self):
        return self.selector.fitted_adapter()

    def reads_in_place(self, layout):
        return layout == self.layout

    def attach_prefix(self, seq, layout, blobs):
        try:
            self.store.attach_prefix(seq, blobs)
        except FileNotFoundError:  # a blob removed after its trailer was read (damage found by another reader)
            pass

    def release_sequence(self, seq):
        self.store.release(seq)
        self.selector.release(seq)

    def close(self):
        """Reads still in flight finish before any file is closed; the first one's error is raised after cleanup."""
        if self.correction is not None:
            self.correction.open_gates()
        futures = [fetch.future for fetch in self._fetches.values() if fetch.future is not None]
        self._fetches.clear()
        errors = self.io.close(futures)
        self.selector.close()
        if self.aside is not None:  # its jobs finish first: none reads from disk
            self.model.lend_aside(None, self)
            self.aside.close()
        self.store.close()
        if errors:
            raise errors[0]
