"""KV on disk, a selected subset in memory: the policy behind ``kvswap``, ``token`` and ``flexgen``.

Per layer and step, data flows one way: the selector picks groups from the coming layer's
predicted query -> the slot table says which are already resident and where misses go ->
the disk store reads the misses (on an I/O thread, overlapping the current layer) ->
attention runs over the selected slots, the sinks and the rolling window.  The window is a
ring of ``window_groups + 1`` groups in memory: the group still being filled (written to disk
as one record when full, its keys then entering K_lr) and the newest full groups.  The sinks
are the first ``sink_groups`` groups, copied into memory once written.  Neither is offered to
the selector, so its picks go to the groups in between.  Records keep the disk's format
(``kv_record_dtype``) in the reuse slots too; attention decodes only the groups it selected,
so quantized records shrink the reads and the slots while the sinks and window stay exact.

Speculate, then correct (``correction: corrected``): the layer-ahead guess buys overlap, and once the layer's own
query is known the groups are scored again over the same K_lr; the corrected picks the guess (or the reuse buffer)
already holds are attended where they sit, and only the rest are read before attention, at most
``correction_reads`` per sequence.  Uncapped, a step attends exactly the groups the oracle selector would pick.
With ``correction_recall`` below 1 a layer whose guess held at least that share of its corrected picks is left
uncorrected for a while, then corrected (and measured) again (``ProbeSchedule``): most layers' guesses are good, and a
correction's rescoring and its synchronous reads cost as much where it changes little as where it changes much.
"""
from __future__ import annotations

import errno
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, TimeoutError as FutureTimeout
from typing import NamedTuple

import numpy as np
import torch

from .aside import AsideThread, PostOrShare
from .disk_store import DiskKVStore, StoreError
from .reader import ReadBatch
from .fetch_plan import FetchPlanner
from .forward import decode_attention, decode_attention_part, merge_attention
from .kv_policy import KVPolicy
from .kernels import Backend, resolve_backend
from .config import RuntimeConfig
from .model import DecoderModel
from .native_build import address
from .record_attention import RecordAttention
from .selector import Selector
from .transfer import to_device
from .slot_memory import LAYERS_IN_FLIGHT, slot_memory
from .slots import Misses, Slots, record_owners
from .guesses import GuessSources, ProbeSchedule, in_rows

_ABANDONED: dict = {}  # id(future) -> (future, buffers) of reads past their deadline: their memory lives until they land
_ABANDONED_LOCK = threading.Lock()


class OffloadedKV(KVPolicy):
    """A decode step per layer, in order: select + fetch (``prefetch``, a layer ahead; at attention time for a
    selector that does not read ahead) -> attend (``attend``: the step's own K/V into its ring slot, wait for
    the reads, correct the picks with the layer's own query if configured, attention over the picks, the sinks and
    the window) -> append and flush (``end_step``: the step's tokens join the window; a full group goes to disk
    and into K_lr; re-clustering when due)."""

    def __init__(self, model: DecoderModel, batch: int, cfg: RuntimeConfig, store: DiskKVStore, selector: Selector,
                 slots: Slots, predict: bool = True, placer=None, on_select=None, backend: Backend | None = None):
        """``cfg``: the policy's effective config (its G, M, S, W, window and recluster settings, read deadline).
        ``predict``: the selector gets the next layer's predicted query (flexgen's picks need none).
        ``placer``: a cluster.CoactivationLayout placing a prompt's groups on the KV paths (None: striped).
        ``on_select(layer, groups [B, M], valid [B, M])``: the step's picks, for tuning and traces (each layer's as it
        attends: in layer order, whichever thread took them)."""
        super().__init__(model, batch, cfg.max_context)
        dims = model.dims
        backend = backend or resolve_backend(model.device)
        self.store = store
        self.layout = store.layout
        self.G = self.layout.group_tokens
        self.M = cfg.picked_groups
        self.selector = selector
        self.slots = slots
        self.use_rolling_buffer = cfg.rolling_buffer
        self.predict = predict
        self._active = np.ones(batch, dtype=bool)
        self.on_select = on_select
        self.placer = placer
        self.prompt_queries = placer.n_queries if placer is not None else 0
        self._observed: dict[int, torch.Tensor] = {}
        self.recluster_steps = cfg.placement.recluster_steps if placer is not None else 0
        self.decode_steps = np.zeros(batch, dtype=np.int64)
        self._picks: dict[tuple[int, int], list[tuple[int, np.ndarray]]] = {}  # (owner, layer) -> (step, groups)
        # records stay in their disk format (quantized ones too) until attention; on a GPU the slots are device
        # memory and only misses cross the bus, or pinned host memory it reads in place (runtime/slot_memory.py)
        self.slot_memory = slot_memory(slots.n_buffers(dims.n_layers), batch, slots.capacity, self.layout,
                                       model.device, batch * self.M, cfg.io.slot_memory)
        self.record_attention = RecordAttention.for_layout(backend, self.layout, dims.n_heads, model.scaling,
                                                           model.dtype)
        # a layer's slots assigned and reads planned in one native call where the parts allow (runtime/fetch_plan.py)
        self._planner = FetchPlanner.for_policy(slots, self.slot_memory, store)
        # on a CPU a helper thread makes the next layer's scores and shares a correction's and the records' attention
        # (runtime/aside.py): the core the step leaves to the reads is idle most of the step
        self.aside = AsideThread.open(backend=backend)
        self.lend_aside(self.aside)
        self.post_or_share = PostOrShare() if self.aside is not None else None
        self._step_started = None  # perf_counter at the step's first prefetch: the steps the PostOrShare choice times
        self.owner = np.arange(batch)  # whose records a sequence's shared leading groups are (share_prefix)
        self.shared_groups = np.zeros(batch, dtype=np.int64)
        self.sink_groups = cfg.sink_groups
        self.window_groups = cfg.window_groups
        self.ring_groups = cfg.window_groups + 1
        self.rolling = torch.zeros(dims.n_layers, batch, 2, dims.n_kv_heads, self.ring_groups * self.G, dims.head_dim,
                                   dtype=model.dtype, device=model.device)
        self.sinks = torch.zeros(dims.n_layers, batch, 2, dims.n_kv_heads, self.sink_groups * self.G, dims.head_dim,
                                 dtype=model.dtype, device=model.device)
        # on a CPU a step's K and V land in the ring by one native call (the native backend's "attend" library's
        # ekv_put_rows), where torch's two index_put calls cost ~70 us a layer inside the step.  The ring as rows of
        # one token's head: each (K|V, sequence, KV head)'s row of layer 0 at ring position 0; a step adds its write
        # positions (``_ring_step_rows``), a layer its offset
        lib = backend.lib("attend")
        self._put_rows = None if lib is None else lib.ekv_put_rows
        self._ring_first_rows = ((np.arange(2)[:, None, None] + 2 * np.arange(batch)[None, :, None]) * dims.n_kv_heads
                                 + np.arange(dims.n_kv_heads)) * self.rolling.shape[4]
        self._ring_layer_rows = self._ring_first_rows.size * self.rolling.shape[4]
        self._ring_row_bytes = dims.head_dim * self.rolling.element_size()
        self._ring_step_rows = None
        self._dense_segments: dict[int, np.ndarray] = {}  # layer -> its sinks and ring as native attention takes them
        self.n_groups = np.zeros(batch, dtype=np.int64)
        self.rb_len = np.zeros(batch, dtype=np.int64)
        self._picking: dict[int, HostPicks] = {}  # layer -> picks launched, not yet on the host
        # layer -> (slots, groups, valid, the reads' future); the picks taken on an I/O thread: (None, None, None, a
        # future of the three)
        self._pending: dict[int, tuple[np.ndarray | None, np.ndarray | None, np.ndarray | None, Future]] = {}
        self._plan_lock = threading.Lock()  # slot tables, the planner and the store's counters: one planner at a time
        self._takes_on_io = True  # where it serves (_io_takes); a bench compares the compute thread taking them
        # a layer's reads start as soon as it is picked, beside the layer before's tail and checksums
        self._io = ThreadPoolExecutor(max_workers=LAYERS_IN_FLIGHT, thread_name_prefix="ekv-io")
        self.read_deadline_s = cfg.io.read_deadline_s
        self._hung: list[Future] = []  # reads that missed the deadline: never waited for again
        self._batch_index = torch.arange(batch, device=model.device)
        self._step = None  # the step's device tensors (_step_tensors), made again when lengths change
        # speculate, then correct: extra reads per sequence and step a correction may make (0: the guess stands)
        self.correction_reads = cfg.correction_slots if predict and selector.reads_ahead else 0
        self.correction_overlap = cfg.predictor.correction_overlap
        self.correction_recall = cfg.predictor.correction_recall
        self._steps = 0  # decode steps of the batch (what the probes count)
        self._probes = ProbeSchedule(dims.n_layers)
        self._sources = GuessSources(dims.n_layers) if cfg.predictor.guess_from_before else None
        self.corrected_layer_steps = np.zeros(2, dtype=np.int64)  # layer-steps corrected, layer-steps attended
        self._correct_io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ekv-fix") if self.correction_reads \
            else None
        self._guess = np.zeros((batch, 0), dtype=np.int64)  # the attended layer's guessed picks, -1 where none
        self.correction_records = np.zeros(batch, dtype=np.int64)
        self.correction_s = 0.0  # rescoring and the reads it waited for, on the compute thread
        self.guess_recall_counts = np.zeros(2, dtype=np.int64)  # corrected picks the guess had, corrected picks
        self._corrected: dict[int, threading.Event] = {}  # layer -> set once its correction read (the next may read)

    @property
    def resident_bytes(self) -> int:
        rolling = self.rolling.numel() * self.rolling.element_size() + self.sinks.numel() * self.sinks.element_size()
        return (self.slot_memory.nbytes + rolling + self.selector.resident_bytes + self.store.table_bytes
                + self.slots.nbytes)

    def start_sequence(self, seq):
        super().start_sequence(seq)
        self._step = None
        self.store.open_sequence(seq)
        self.slots.reset(seq)
        self._probes.reset()  # a new prompt: every layer's guess is measured again
        if self._sources is not None:
            self._sources.reset()
        self.n_groups[seq] = 0
        self.rb_len[seq] = 0
        self.owner[seq] = seq
        self.shared_groups[seq] = 0
        self.decode_steps[seq] = 0
        self._picks = {key: kept for key, kept in self._picks.items() if key[0] != seq}

    def share_prefix(self, seq, owner, n_groups):
        """``seq``'s first ``n_groups`` groups are ``owner``'s: it reads them from the owner's records, through
        one reuse pool, so a group both pick is read once and then hit by both."""
        self.store.share_prefix(seq, owner, n_groups)
        self.owner[seq], self.shared_groups[seq] = owner, n_groups
        self.slots.share([owner, seq])  # joins the pool of the owner's other borrowers too

    def observe_prompt(self, layer, seq, q):
        self._observed[layer] = q

    def store_prompt(self, layer, seq, k, v):
        n_full = k.shape[1] // self.G
        tokens = n_full * self.G
        q = self._observed.pop(layer, None)
        if q is not None and self.shared_groups[seq] == 0:  # a borrower writes only its own tail: striped
            self._lay_out(layer, seq, q, k, n_full)
        self.store.write_groups(seq, layer, 0, self.layout.pack(k[:, :tokens], v[:, :tokens]))
        self.selector.append(layer, seq, 0, k[:, :tokens])
        for group in [*range(min(n_full, self.sink_groups))] + [*range(max(0, n_full - self.window_groups), n_full + 1)]:
            span = slice(group * self.G, min((group + 1) * self.G, k.shape[1]))
            self._keep_group(layer, seq, group, k[:, span], v[:, span], in_ring=group >= n_full - self.window_groups)
        rest = k.shape[1] - tokens
        self._step = None
        if layer == self.model.dims.n_layers - 1:
            self.n_groups[seq] = n_full
            self.rb_len[seq] = rest

    def _lay_out(self, layer: int, seq: int, q: torch.Tensor, k: torch.Tensor, n_full: int) -> None:
        """Place the prompt's groups by co-activation before they are written; the picks seen also seed
        the cost-aware reuse buffer (activation frequency, refetch cost)."""
        end = max(self.sink_groups, n_full - self.window_groups)
        per_path, activation, cost = self.placer(q, k, self.G, self.M, self.sink_groups, end, self.store.n_paths)
        self.store.place(seq, layer, per_path)
        groups = np.arange(n_full)
        self.slots.replacement.set_prior(layer, seq, groups, activation)
        self.slots.replacement.set_cost(layer, seq, groups, cost)

    def end_prefill(self):
        self.selector.end_prefill()

    def lend_aside(self, aside: AsideThread | None) -> None:
        """Lend the helper thread to what computes beside it (the selector's scores, the records' attention); None
        withdraws it (a bench comparing)."""
        self.selector.aside = aside
        self.model.lend_aside(aside, self)
        if self.record_attention is not None:
            self.record_attention.aside = aside

    # ---- the decode step: select + fetch -> attend -> append -> flush ------------------------------

    def prefetch(self, layer, x, rope, active):
        """Select + fetch, a layer ahead: the picks from the layer's predicted query, their reads on an I/O thread
        while the layer before computes (a selector needing the true query waits for ``attend``).  On a GPU the
        picks reach the host in one copy queued behind the selection, and the host takes them when the layer before
        attends: its QKV is queued by then, so the device does not run dry while the host assigns slots."""
        self._active = active
        if layer == 0:
            self._step_started = time.perf_counter()
        if self.selector.reads_ahead:
            started = time.perf_counter()
            before = self._sources.before(layer) if self._sources is not None else None
            if before is not None:  # the layer's own picks of the step before: nothing to score
                self._picking[layer] = HostPicks(torch.from_numpy(before), active)
            else:
                self._picking[layer] = self._launch_pick(layer, self.model.query(layer, x, rope) if self.predict
                                                         else None, post=self.post_or_share is None
                                                         or self.post_or_share.posting)
            self.select_s += time.perf_counter() - started
            if self._io_takes(active) and not self._picking[layer].ready():  # on an I/O thread, once made
                picks = self._picking.pop(layer)
                after = self._after(layer)
                self._pending[layer] = (None, None, None, self._io.submit(self._take_on_io, layer, picks, after))
            elif self.model.device.type != "cuda":  # no queue to keep fed: the reads start once the picks are made
                self._take_picks(wait_upto=-1)

    def take_picks(self) -> None:
        """The launched picks on the host, in layer order: slots assigned and the misses' reads submitted (at each
        attention; a hybrid model's local layers call it too, so a global layer's reads start a layer ahead)."""
        self._take_picks(wait_upto=None)

    def _take_picks(self, wait_upto: int | None) -> None:
        """``take_picks``, waiting only for the layers up to ``wait_upto`` (None: every one): a later layer's picks
        are taken while they are made, and the rest wait for the next call."""
        while self._picking:
            layer = next(iter(self._picking))
            picks = self._picking[layer]
            if wait_upto is not None and layer > wait_upto and not picks.ready():
                return
            del self._picking[layer]
            started = time.perf_counter()
            self._fetch_picks(layer, *picks.result(), picks.active, started)

    def _fetch_picks(self, layer: int, groups: np.ndarray, valid: np.ndarray, active: np.ndarray, started: float
                     ) -> None:
        """The layer's picks on the host: the slot table says which are resident, the misses' reads go to an I/O
        thread, and the layer's attention finds them pending."""
        if self.recluster_steps and (self.decode_steps[active] < self.recluster_steps).any():  # until all re-laid
            self._keep_picks(layer, groups, valid, record_owners(groups, self.owner, self.shared_groups))
        slots, misses, reads = self._planned(layer, groups, valid)
        self.select_s += time.perf_counter() - started
        future = self._io.submit(self._fetch, layer, self.slots.buffer_index(layer), misses, reads, self._after(layer))
        self._pending[layer] = (slots, groups, valid, future)

    def _planned(self, layer: int, groups: np.ndarray, valid: np.ndarray) -> tuple[np.ndarray, Misses, ReadBatch]:
        """The picks' flat slots, the misses and the misses' reads (their bytes counted), under ``_plan_lock``: the
        compute thread and an I/O thread both assign and plan."""
        with self._plan_lock:
            slots, misses, reads = self._assign(layer, groups, valid)
            return slots, misses, self._plan_reads(layer, misses, reads)

    def _assign(self, layer: int, groups: np.ndarray, valid: np.ndarray) -> tuple[np.ndarray, Misses, ReadBatch | None]:
        """The picks' flat slots, the misses and, where the planner served, the misses' reads."""
        if self._planner is not None and not self.shared_groups.any():  # it takes each row's own records only
            planned = self._planner.plan(layer, groups, valid)
            if planned is not None:
                return planned
        return (*self.slots.assign(layer, groups, valid, record_owners(groups, self.owner, self.shared_groups)), None)

    def _io_takes(self, active: np.ndarray) -> bool:
        """Whether an I/O thread takes picks still being made (assigns their slots, plans and reads the misses) the
        moment the helper thread has made them, instead of the compute thread once the layer before has attended
        (picks made already are taken at once, as ever).  On a CPU with the one-call planner, where no re-clustering
        keeps the picks first and each row reads its own records."""
        return (self._takes_on_io and self._planner is not None and self.model.device.type == "cpu"
                and not self.shared_groups.any()
                and not (self.recluster_steps and (self.decode_steps[active] < self.recluster_steps).any()))

    def _after(self, layer: int) -> threading.Event | None:
        """The gate of ``layer``'s reads when the layer before corrects this step (its reads go first, ``_fetch``)."""
        if (layer - 1) in self._pending and self._corrects(layer - 1):
            self._corrected[layer - 1] = threading.Event()
            return self._corrected[layer - 1]
        return None

    def _take_on_io(self, layer: int, picks: "HostPicks | ScoredPicks", after: threading.Event | None
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """On an I/O thread: ``layer``'s picks once made, their slots assigned and the misses read (the planner and
        the slot tables under ``_plan_lock``: the compute thread's corrections assign and plan too).  Returns the
        layer's slots, groups and valid."""
        groups, valid = picks.result()
        slots, misses, reads = self._planned(layer, groups, valid)
        self._fetch(layer, self.slots.buffer_index(layer), misses, reads, after)
        return slots, groups, valid

    def _corrects(self, layer: int) -> bool:
        """Whether ``layer`` corrects its guess this step."""
        return bool(self.correction_reads) and self._probes.due(layer, self._steps)

    def _launch_pick(self, layer: int, q: torch.Tensor | None, post: bool = False) -> "HostPicks | ScoredPicks":
        """The selector's picks for ``layer`` from query ``q``, on their way to the host; ``post``: the selector may
        post its scoring to the helper thread (``Selector.launch``) and still be making them when this returns."""
        outside_window = torch.from_numpy(np.maximum(self.n_groups - self.window_groups, 0))
        if post:
            picking = self.selector.launch(layer, q, outside_window, first=self.sink_groups)
            if not picking.ready():
                return ScoredPicks(picking, self._active)
            groups, valid = picking.result()
        else:
            groups, valid = self.selector.select(layer, q, outside_window, first=self.sink_groups)
        return HostPicks(torch.where(valid, groups, -1), self._active)

    def _pick(self, layer: int, q: torch.Tensor | None) -> tuple[np.ndarray, np.ndarray]:
        """The picks for ``layer`` from ``q`` on the host now: groups [B, M], valid [B, M] (active rows only)."""
        return self._launch_pick(layer, q).result()

    def _read_misses(self, layer: int, misses, executor: ThreadPoolExecutor) -> Future:
        """The misses' reads, submitted to ``executor``; their bytes count as read."""
        with self._plan_lock:
            reads = self._plan_reads(layer, misses, None)
        return executor.submit(self._fetch, layer, self.slots.buffer_index(layer), misses, reads)

    def _plan_reads(self, layer: int, misses, reads: ReadBatch | None) -> ReadBatch:
        """The misses' reads (``reads``: planned already), their bytes counted as read."""
        self.bytes_read += np.bincount(misses.seq, minlength=self.batch) * self.layout.stride_bytes
        if reads is None:
            addresses = self.slot_memory.read_addresses(layer, self.slots.buffer_index(layer), misses)
            reads = self.store.batch(layer, misses.seq, misses.group, addresses)
        return reads

    def _fetch(self, layer: int, buffer: int, misses, reads, after: threading.Event | None = None) -> None:
        """On an I/O thread: the misses read from disk (checksums checked), then moved where attention reads them.
        ``after`` (with correction): set once the layer before's correction has landed (or needed no reads); that
        layer's few reads hold up its attention, so they go first instead of sharing the disk with this whole
        layer's (sharing: 0.86x the step), and this read starts the moment they land, overlapping that layer's
        attention and MLP (set once that layer had attended instead: down to 0.90x where many layers correct)."""
        if after is not None:
            after.wait(timeout=self.read_deadline_s)
        self.slot_memory.before_read(layer, buffer)
        self.read_time.begin()
        try:
            self.store.read(reads)
        finally:
            self.read_time.end()
        self.slot_memory.after_read(layer, buffer, misses)

    def _keep_group(self, layer: int, seq: int, group: int, k: torch.Tensor, v: torch.Tensor, in_ring: bool) -> None:
        """Hold (part of) ``group`` in memory: in the sinks if it is one, in its ring slot if ``in_ring``."""
        n = k.shape[1]
        if group < self.sink_groups:
            self.sinks[layer, seq, 0, :, group * self.G : group * self.G + n] = k
            self.sinks[layer, seq, 1, :, group * self.G : group * self.G + n] = v
        if in_ring:
            start = (group % self.ring_groups) * self.G
            self.rolling[layer, seq, 0, :, start : start + n] = k
            self.rolling[layer, seq, 1, :, start : start + n] = v

    def _step_tensors(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(the step's ring write position [B], the resident mask) on the compute device: the same for every layer
        of a step, so made once a step (one transfer, none per layer)."""
        if self._step is None:
            write_at = self.n_groups % self.ring_groups * self.G + self.rb_len
            self._step = (to_device(write_at, device), self._resident_mask(device))
            self._ring_step_rows = np.ascontiguousarray(self._ring_first_rows + write_at[:, None])
        return self._step

    def _write_ring(self, layer: int, k: torch.Tensor, v: torch.Tensor, write_at: torch.Tensor) -> None:
        """The step's own K and V [B, H_kv, 1, d] into their ring slot of ``layer`` (at ``write_at`` [B])."""
        if self._put_rows is not None and k.is_contiguous() and v.is_contiguous() and k.dtype == self.rolling.dtype:
            self._put_rows(self.rolling.data_ptr(), self._ring_row_bytes, address(self._ring_step_rows),
                           layer * self._ring_layer_rows, k.data_ptr(), v.data_ptr(), k.shape[0] * k.shape[1])
            return
        rolling = self.rolling[layer]
        rolling[self._batch_index, 0, :, write_at] = k[:, :, 0]
        rolling[self._batch_index, 1, :, write_at] = v[:, :, 0]

    def _resident_mask(self, device) -> torch.Tensor:
        """[B, S + (W + 1) * G]: which sink and ring positions hold tokens to attend (never one the picks hold)."""
        n_groups = to_device(self.n_groups, device)[:, None]
        sink_group = torch.arange(self.sink_groups * self.G, device=device) // self.G
        sinks = sink_group < n_groups
        ring_slot = torch.arange(self.ring_groups, device=device)
        group = n_groups - (n_groups - ring_slot) % self.ring_groups  # [B, R]: the newest group in each ring slot
        position = torch.arange(self.G, device=device)
        rb_pos = to_device(self.rb_len, device)[:, None, None]
        filling = position <= rb_pos if self.use_rolling_buffer else position == rb_pos
        full = ((group >= 0) & (group >= self.sink_groups))[..., None].expand(-1, -1, self.G)
        ring = torch.where((group == n_groups)[..., None], filling, full)
        return torch.cat([sinks, ring.reshape(len(self.n_groups), -1)], dim=1)

    def attend(self, layer, q, k, v):
        """Attention over the fetched picks, the sinks and the window; the step's own K/V sit in their ring slot
        first (a token attends to itself) and join the window for good at ``end_step``.  With
        ``correction_overlap`` the picks in memory are attended while the correction's reads land, then those.
        The next layer's picks are taken before it (a GPU's: its QKV is queued, and their reads start while this
        layer's land) or, on a CPU, once made: those scored beside this attention are taken after it."""
        if self.model.device.type != "cpu":
            self.take_picks()  # this layer's (if not yet) and the next one's
            return self._attend(layer, q, k, v)
        self._take_picks(wait_upto=layer)
        out = self._attend(layer, q, k, v)
        self.take_picks()  # the next layer's: their reads overlap this layer's MLP
        return out

    def _attend(self, layer, q, k, v):
        if not self.selector.reads_ahead:
            started = time.perf_counter()
            self._fetch_picks(layer, *self._pick(layer, q), self._active, started)
        write_at, resident = self._step_tensors(q.device)
        self._write_ring(layer, k, v, write_at)
        correcting = self._corrects(layer)
        self.corrected_layer_steps += [correcting, 1]
        if correcting:  # rescored while the guess's reads may still be landing
            started = time.perf_counter()
            corrected = self._pick(layer, q)
            self.correction_s += time.perf_counter() - started
        try:
            slots, valid = self._wait_fetch(layer)
            late = None
            if correcting:
                slots, valid, late = self._correct(layer, *corrected)
            if late is None:
                return self._attention(layer, q, slots, valid, resident)
            reads, arriving = late
            parts = [decode_attention_part(self.model, q, *self._keys_values(
                layer, q, np.where(arriving, reads.safe_slot, slots), valid & ~arriving, resident))]
            started = time.perf_counter()
            self._wait(layer, reads.future)
            self.correction_s += time.perf_counter() - started
        finally:
            if layer in self._corrected:  # the next layer's read may start
                self._corrected.pop(layer).set()
        columns = np.argsort(~arriving, axis=1, kind="stable")[:, : int(arriving.sum(axis=1).max())]
        parts.append(decode_attention_part(self.model, q, *self._keys_values(
            layer, q, np.take_along_axis(slots, columns, 1), np.take_along_axis(arriving, columns, 1))))
        return merge_attention(parts, q.dtype)

    def _attention(self, layer: int, q: torch.Tensor, slots: np.ndarray, valid: np.ndarray,
                   resident: torch.Tensor) -> torch.Tensor:
        """The layer's attention over its picks in flat ``slots`` [B, M] (where ``valid``), the sinks and the window:
        straight from the slots where the native kernel serves, else through a gathered copy."""
        if self.record_attention is not None:
            records = self.slot_memory.buffer_records(self.slots.buffer_index(layer))
            dense = self._dense_segments.get(layer)
            if dense is None:  # the sinks and the ring stay where they are: found once a layer
                dense = self._dense_segments[layer] = self.record_attention.segments([self.sinks[layer],
                                                                                      self.rolling[layer]])
            return self.record_attention(q, records, slots, valid, dense, resident)
        keys, values, mask = self._keys_values(layer, q, slots, valid, resident)
        return decode_attention(self.model, q, keys, values, mask)

    def _keys_values(self, layer: int, q: torch.Tensor, slots: np.ndarray, valid: np.ndarray,
                     resident: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Keys and values [B, H_kv, S, d] and the mask [B, 1, 1, S] of the picks in flat ``slots`` [B, M] (only the
        selected records are gathered, one copy each, and decoded on the compute device), then the sinks and the
        window when ``resident`` (their mask) is given."""
        records = self.slot_memory.gather(layer, self.slots.buffer_index(layer), torch.from_numpy(slots))
        selected = self.layout.decode(records, self.model.dtype)  # [B, M, K|V, H_kv, G, d]
        b, m, _, h_kv, g, d = selected.shape
        kv = selected.permute(2, 0, 3, 1, 4, 5).reshape(2, b, h_kv, m * g, d)  # K and V in one copy
        mask = to_device(np.repeat(valid, g, axis=1), q.device)
        if resident is not None:
            kv = torch.cat([kv, self.sinks[layer].transpose(0, 1), self.rolling[layer].transpose(0, 1)], dim=3)
            mask = torch.cat([mask, resident], dim=1)
        keys, values = kv
        return keys, values, mask[:, None, None, :]

    def _wait_fetch(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """(slots, valid) of the layer's picks once their reads landed; the picks stay for ``_correct``."""
        slots, groups, valid, future = self._pending.pop(layer)
        start = time.perf_counter()
        self._wait(layer, future)
        self.io_stall_s += time.perf_counter() - start
        if slots is None:  # taken on an I/O thread (_take_on_io)
            slots, groups, valid = future.result()
        if self.on_select is not None:  # here, in layer order, whichever thread took them
            self.on_select(layer, groups, valid)
        self._guess = np.where(valid, groups, -1)
        return slots, valid

    def _wait(self, layer: int, future: Future) -> None:
        """Wait for a read of ``layer``; one past ``read_deadline_s`` fails (and is never waited for again)."""
        try:
            future.result(timeout=self.read_deadline_s)
        except FutureTimeout:
            self._hung.append(future)
            raise StoreError(errno.ETIMEDOUT, f"the KV read of layer {layer} did not finish within read_deadline_s="
                             f"{self.read_deadline_s:g} s: the KV device under {self.store.root} hangs or is far slower "
                             "than profiled; check it, or raise read_deadline_s") from None

    def _correct(self, layer: int, groups: np.ndarray, valid: np.ndarray
                 ) -> tuple[np.ndarray, np.ndarray, tuple["CorrectionReads", np.ndarray] | None]:
        """Speculate, then correct: ``groups``/``valid`` are the picks scored again with the layer's own query; those
        in memory (the guess's, or still in the reuse slots) are attended where they are and the rest read now, at
        most ``correction_reads`` per sequence (past the cap, the guess's other picks stand in).  Returns the
        corrected (slots, valid) and, with ``correction_overlap`` while reads are pending, (the reads, which picks
        they bring [B, M]); else the reads have landed."""
        started = time.perf_counter()
        guessed = valid & in_rows(groups, self._guess)  # the corrected picks the guess had
        from_before = self._sources is not None and self._sources.before(layer) is not None
        if self.correction_recall < 1:  # a guess from the step before goes stale uncorrected: it keeps correcting
            self._probes.measured(layer, self._steps, not from_before and valid.any()
                                  and guessed.sum() >= self.correction_recall * valid.sum())
        if self._sources is not None:
            self._sources.corrected(layer, self._steps, groups, valid, guessed,
                                    self._probes.due(layer, self._steps + 1))
        owners = record_owners(groups, self.owner, self.shared_groups)
        missing = valid & ~self.slots.resident(layer, groups, owners)
        over = missing & (np.cumsum(missing, axis=1) > self.correction_reads)
        if over.any():  # past the cap the guess's picks stand in: each one the guess had
            groups, valid = _fill_from_guess(groups, valid, over, self._guess)
            owners = record_owners(groups, self.owner, self.shared_groups)
            missing &= ~over  # the guess's picks standing in are in memory
            guessed = (guessed & ~over) | (valid & over)
        self.guess_recall_counts += [int(guessed.sum()), int(valid.sum())]
        with self._plan_lock:
            slots, misses = self.slots.correct(layer, groups, valid, owners)
        late = None
        gate = self._corrected.get(layer)  # the next layer's read, waiting for this one's (set again in attend)
        if len(misses.seq):
            future = self._read_misses(layer, misses, self._correct_io)
            if gate is not None:  # it starts as this one lands, not once this layer has attended
                future.add_done_callback(lambda _: gate.set())
            self.correction_records += np.bincount(misses.seq, minlength=self.batch)
            safe_slot = _free_slot(misses.slot) if self.correction_overlap else -1
            if 0 <= safe_slot < self.batch * self.slots.capacity:
                late = CorrectionReads(future, safe_slot), missing
            else:  # one attention once they land (no overlap asked, or every slot is landing)
                self._wait(layer, future)
        elif gate is not None:
            gate.set()
        self.correction_s += time.perf_counter() - started
        return slots, valid, late

    def end_step(self, active):
        """Append: the step's tokens join the window.  Flush: a window group now full goes to disk and into K_lr.
        Then the sequences whose decode picks are due are clustered again."""
        super().end_step(active)
        self._step = None
        self._steps += 1
        self.rb_len[active] += 1
        full = np.flatnonzero(self.rb_len == self.G)
        if len(full):
            spans = [self._ring_span(int(seq)) for seq in full]
            # one transfer for every full group of the step (on a GPU its one sync), not two per layer
            on_host = torch.stack([self.rolling[:, seq, :, :, span] for seq, span in zip(full, spans)]).cpu()
            for seq, span, kv in zip(full, spans, on_host):
                self._flush_group(int(seq), span, kv)
        self.decode_steps[active] += 1
        for seq in np.flatnonzero(active & (self.decode_steps == self.recluster_steps)) if self.recluster_steps else ():
            self._recluster(int(seq))
        if self.post_or_share is not None and self._step_started is not None:  # from its first prefetch: no pause
            self.post_or_share.took(time.perf_counter() - self._step_started)  # between steps counts

    # ---- re-clustering (several KV paths) ----------------------------------------------------------

    def _keep_picks(self, layer: int, groups: np.ndarray, valid: np.ndarray, owners: np.ndarray) -> None:
        """The step's picks per record owner, until that owner's layers are clustered again."""
        for b in np.flatnonzero(valid.any(axis=1)).tolist():
            for owner in np.unique(owners[b][valid[b]]).tolist():
                if self.decode_steps[owner] < self.recluster_steps:
                    mine = valid[b] & (owners[b] == owner)
                    self._picks.setdefault((owner, layer), []).append((int(self.decode_steps[owner]), groups[b][mine]))

    def _resident_records(self, layer: int, owner: int, groups: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(held mask, records [held, stride]) of ``owner``'s groups that sit in this layer's reuse slots."""
        slots = self.slots.held(layer, owner, groups)
        held = slots >= 0
        return held, self.slot_memory.records(self.slots.buffer_index(layer), slots[held])

    def _recluster(self, seq: int) -> None:
        """Cluster each layer's decode picks of ``seq`` and write the picked groups once more in that order over the
        KV paths (a stored context's groups too: its queries say how to lay them out).  With a reuse buffer only
        the groups it holds move (the picks that are still hot; no read), without one every picked group is read
        and moved.  Between steps: no read is in flight."""
        for layer in range(self.model.dims.n_layers):
            kept = self._picks.pop((seq, layer), [])
            if not kept:
                continue
            picks = np.zeros((self.recluster_steps, int(self.n_groups[seq])), dtype=bool)
            for step, groups in kept:
                picks[step, groups] = True
            per_path, cost = self.placer.refine(picks, self.store.n_paths)
            if self.slots.keeps_records:  # with reuse, move what the slots hold: written, never read again
                per_path = [groups[self.slots.held(layer, seq, groups) >= 0] for groups in per_path]
            self.store.relocate(seq, layer, per_path, lambda groups: self._resident_records(layer, seq, groups))
            moved = np.concatenate(per_path)
            self.slots.replacement.set_cost(layer, seq, moved, cost[moved])

    def _ring_span(self, seq: int) -> slice:
        """The ring positions of the group ``seq`` is filling."""
        slot = int(self.n_groups[seq]) % self.ring_groups
        return slice(slot * self.G, (slot + 1) * self.G)

    def _flush_group(self, seq: int, span: slice, on_host: torch.Tensor) -> None:
        """The rolling buffer of ``seq`` is one full group (``on_host``: its K/V [L, 2, H_kv, G, d] on the host): write
        it to disk and add its keys to K_lr, every layer's record packed at once and every layer's keys projected
        at once (one call each, not one a layer)."""
        group = int(self.n_groups[seq])
        records = self.layout.pack(*(on_host[:, i].transpose(0, 1).flatten(1, 2) for i in (0, 1)))  # [L, stride]
        self.store.write_layers(seq, group, records[:, None])
        self.selector.append_layers(seq, group * self.G, self.rolling[:, seq, 0, :, span])
        for layer in range(self.model.dims.n_layers) if group < self.sink_groups else ():
            self._keep_group(layer, seq, group, self.rolling[layer, seq, 0, :, span],
                             self.rolling[layer, seq, 1, :, span], in_ring=False)
        self.n_groups[seq] += 1
        self.rb_len[seq] = 0

    # ---- stats and release ------------------------------------------------------------------------

    def reuse_counts(self):
        return self.slots.hits.copy(), self.slots.lookups.copy()

    def stats(self, seq):
        store = self.store
        recalled, corrected = self.guess_recall_counts
        corrected_layers, attended = self.corrected_layer_steps
        return {**super().stats(seq), "o_direct": store.o_direct, "n_paths": store.n_paths,
                "kv_read_requests": store.requests, "kv_records_read": store.records_read,
                "kv_gap_records_read": store.gap_records_read,
                "kv_records_by_path": store.records_by_path.tolist(), "kv_records_verified": store.records_verified,
                "kv_records_reread": store.records_reread, "scorer_fallback": None,
                "kv_correction_records": int(self.correction_records[seq]), "correction_s": self.correction_s,
                "guess_recall": float(recalled / corrected) if corrected else None,
                "corrected_layer_share": float(corrected_layers / attended) if self.correction_reads and attended
                else None,
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
        """Reads still in flight finish before any file is closed; the first one's error is raised after cleanup.
        A read past its deadline is not waited for: its buffers are kept alive until it lands, and the files
        close under it (the kernel holds them for a syscall in progress)."""
        for gate in self._corrected.values():  # no correction is coming: queued reads may start (and finish)
            gate.set()
        futures = [future for *_, future in self._pending.values()]
        self._pending.clear()
        self._picking.clear()
        errors = []
        for future in futures:
            if self._hung and future.cancel():  # queued behind a hung read: never started
                continue
            try:
                error = future.exception(timeout=self.read_deadline_s)
            except FutureTimeout:
                self._hung.append(future)
                continue
            if error is not None:
                errors.append(error)
        hung = [f for f in self._hung if not f.done()]
        for future in hung:
            with _ABANDONED_LOCK:
                _ABANDONED[id(future)] = (future, self.slot_memory)
            future.add_done_callback(_forget_abandoned)
        self._io.shutdown(wait=not hung)
        if self._correct_io is not None:
            self._correct_io.shutdown(wait=not hung)
        self.selector.close()
        if self.aside is not None:  # its jobs finish first: none reads from disk
            self.model.lend_aside(None, self)
            self.aside.close()
        self.store.close()
        if errors:
            raise errors[0]


class HostPicks:
    """A layer's picks [B, M] (-1: none) on their way to the host: on a GPU one copy into pinned memory queued behind
    the selection, with an event, so ``result`` waits for that copy and never for work queued after it."""

    def __init__(self, picks: torch.Tensor, active: np.ndarray):
        self.active, self._event = active, None  # the rows decoding when the picks were made
        if picks.device.type == "cuda":
            self._host = torch.empty(picks.shape, dtype=picks.dtype, pin_memory=True)
            self._host.copy_(picks, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream(picks.device))
        else:
            self._host = picks

    def ready(self) -> bool:
        """Whether ``result`` would not wait."""
        return self._event is None or self._event.query()

    def result(self) -> tuple[np.ndarray, np.ndarray]:
        """groups [B, M] (0 where none) and valid [B, M] (a pick, in an active row)."""
        if self._event is not None:
            self._event.synchronize()  # the layer's one wait for the device
        return _on_host(self._host.numpy(), self.active)


class ScoredPicks:
    """A layer's picks still being made beside the compute thread (``Selector.launch`` on a CPU), taken as
    ``HostPicks`` are."""

    def __init__(self, picking, active: np.ndarray):
        self.picking, self.active = picking, active

    def ready(self) -> bool:
        return self.picking.ready()

    def result(self) -> tuple[np.ndarray, np.ndarray]:
        return _on_host(self.picking.host(), self.active)


def _on_host(picks: np.ndarray, active: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Picks [B, M] (-1: none) as groups (0 where none) and valid (a pick, in an ``active`` row)."""
    return np.maximum(picks, 0), (picks >= 0) & active[:, None]


class CorrectionReads(NamedTuple):
    """A correction's reads in flight, and a flat slot none of them writes (what the other part's gather may read
    in place of the slots still landing)."""

    future: Future
    safe_slot: int


def _free_slot(written: np.ndarray) -> int:
    """The lowest flat slot not among ``written``."""
    taken = np.zeros(len(written) + 1, dtype=bool)
    taken[written[written <= len(written)]] = True
    return int(np.argmin(taken))


def _fill_from_guess(groups: np.ndarray, valid: np.ndarray, over: np.ndarray, guess: np.ndarray
                     ) -> tuple[np.ndarray, np.ndarray]:
    """Corrected picks past the cap of extra reads (``over``) give way to the guess's picks the correction
    dropped (in memory already), the guess's best first; with none left a pick is dropped."""
    groups, valid = groups.copy(), valid & ~over
    for b in np.flatnonzero(over.any(axis=1)):
        spare = guess[b][(guess[b] >= 0) & ~np.isin(guess[b], groups[b][valid[b]])]
        at = np.flatnonzero(over[b])[: len(spare)]
        groups[b, at], valid[b, at] = spare[: len(at)], True
    return groups, valid


def _forget_abandoned(future) -> None:
    with _ABANDONED_LOCK:
        _ABANDONED.pop(id(future), None)
