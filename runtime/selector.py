"""Selectors decide which on-disk groups a layer attends to; they know scores, not bytes.

``LowRankSelector`` is KVSwap's grouped predictor: the low-rank queries of the coming layer
against the in-memory K_lr, scores summed over heads, ReduceMax per group of G tokens,
top-M groups.  Summing over heads commutes with the projection, so the heads of one KV
group are summed before projecting: one [r]-vector per sequence instead of H of them.  On a
CPU's native backend (runtime/kernels.py) one call (runtime/native/ekv_score.c) scores the rows, reduces over heads and
takes each group's maximum; the torch backend and a GPU take the torch path to the same scores.
``AllGroupsSelector`` picks every group (FlexGen: the whole layer is loaded).
"""
from __future__ import annotations

import numpy as np
import torch

from typing import TYPE_CHECKING, Callable, NamedTuple

from .native_build import address
from .adapter import KEYS_PER_RANK, LowRankAdapter
from .aside import AsideThread, run_units
from .choices import KLR_FORMATS
from .kernels import Backend, resolve_backend
from .transfer import to_device

if TYPE_CHECKING:
    from .config import PredictorConfig
    from .model import ModelDims


class Selector:
    """Interface: keep whatever metadata the choice needs, and choose up to M groups per sequence.

    ``reads_ahead``: it picks from the next layer's predicted query, so the reads overlap the current layer;
    a selector that needs the layer's own query (the oracle) picks at attention time and its reads stall."""

    resident_bytes = 0
    reads_ahead = True
    aside: AsideThread | None = None  # the decode step's helper thread, lent by the policy on a CPU
    uses_adapter = False  # predicts through a low-rank K adapter (a file, or one fitted on the batch)

    def append(self, layer: int, seq: int, first_token: int, k: torch.Tensor) -> None:
        """New post-RoPE keys k [H_kv, T, d] of one sequence, starting at ``first_token``."""

    def append_layers(self, seq: int, first_token: int, k: torch.Tensor) -> None:
        """``append`` for every layer at once: k [L, H_kv, T, d] (a decode step's flushed group)."""
        for layer in range(k.shape[0]):
            self.append(layer, seq, first_token, k[layer])

    def select(self, layer: int, q: torch.Tensor | None, n_groups: torch.Tensor, first: int = 0
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: the layer's predicted queries [B, H, 1, d]; choose among groups ``first <= g < n_groups[b]``
        (the sinks before ``first`` and the window from ``n_groups`` on are attended anyway).  ``n_groups`` is on
        the host (the engine's counts): a selection never waits for the device to learn them.

        Returns groups [B, M] (long) and valid [B, M] (bool; False pads sequences with fewer groups).
        """
        raise NotImplementedError

    def launch(self, layer: int, q: torch.Tensor | None, n_groups: torch.Tensor, first: int = 0) -> "Picking":
        """``select``'s picks, which a selector may still be making when this returns (a layer ahead, beside the
        caller's compute); the caller takes them when it needs them.  Default: made now."""
        return Picked(*self.select(layer, q, n_groups, first))

    def release(self, seq: int) -> None:
        """The sequence is done: drop what the selector keeps for it."""

    def end_prefill(self) -> None:
        """Every prompt of the batch is stored; decoding starts."""

    def fitted_adapter(self) -> tuple[LowRankAdapter | None, int]:
        """A projection fitted on the batch's own keys and the fewest keys a layer's fit saw; (None, 0): none."""
        return None, 0

    def stats(self) -> dict:
        """What the selector reports beside the policy's stats (e.g. why scoring fell back to the CPU)."""
        return {}

    def close(self) -> None:
        pass


class AllGroupsSelector(Selector):
    def __init__(self, max_groups: int, device: torch.device):
        self._all = torch.arange(max_groups, device=device)

    def select(self, layer, q, n_groups, first=0):
        groups = self._all.expand(n_groups.shape[0], -1)
        return groups, (groups >= first) & (groups < n_groups.to(groups.device)[:, None])


class RandomSelector(Selector):
    """M groups drawn uniformly: the floor a real predictor must beat (quality ablations only)."""

    @classmethod
    def for_batch(cls, adapter, rank, dims, batch, cfg, backend, scaling):
        return cls(cfg.picked_groups)

    def __init__(self, picked_groups: int, seed: int = 0):
        self.picked_groups = picked_groups
        self.generator = torch.Generator().manual_seed(seed)

    def select(self, layer, q, n_groups, first=0):
        batch = n_groups.shape[0]
        noise = torch.rand(batch, int(n_groups.max()) or 1, generator=self.generator)
        index = torch.arange(noise.shape[1])
        noise[(index >= n_groups[:, None]) | (index < first)] = -1.0
        top = noise.topk(min(self.picked_groups, noise.shape[1]), dim=-1)
        groups = torch.zeros(batch, self.picked_groups, dtype=torch.long)
        valid = torch.zeros(batch, self.picked_groups, dtype=torch.bool)
        groups[:, : top.indices.shape[1]] = top.indices
        valid[:, : top.indices.shape[1]] = top.values >= 0
        return groups, valid


CPU_BLOCK_BYTES = 2 << 20  # float32 K_lr rows a CPU select converts at a time (LowRankSelector._times_rows)
INT_LEVELS = {8: 127, 4: 7}  # the largest magnitude of a symmetric integer row element
NATIVE_ROWS = {"float32": 0, "bfloat16": 1, "int8": 2, "int4": 3}  # the K_lr formats ekv_score.c reads (its kinds)
# K_lr is stored this many tokens a block, rank-major within a block: the native scorer reads a block as one
# contiguous stretch (its BLOCK; ekv_score.c block_of says why)
KLR_BLOCK_TOKENS = 64


def klr_layer_bytes(rank: int, klr_dtype: str, max_context: int) -> int:
    """Bytes of one layer's K_lr rows and scales for a sequence of ``max_context`` tokens (the rows in whole blocks)."""
    _, bits, scale = KLR_FORMATS[klr_dtype]
    return klr_blocks(max_context) * KLR_BLOCK_TOKENS * -(-rank * bits // 8) + max_context * scale


def klr_blocks(max_context: int) -> int:
    """The stored blocks of ``max_context`` tokens' K_lr rows."""
    return -(-max_context // KLR_BLOCK_TOKENS)


class LowRankSelector(Selector):
    """``adapter`` None: each layer's projection is fitted on the keys of every prompt of the batch
    (``end_prefill``, or the first selection), then those keys are projected; ``fitted_on`` says how
    many keys each fit saw.  A calibrated adapter from the install step is better; the engine warns.

    ``prompt_adapter`` (the config's): each sequence projects through its own projection, fitted on its prompt's
    keys a layer at a time as the prompt is stored (ShadowKV's per-request SVD), where the prompt gives
    ``KEYS_PER_RANK`` x rank keys; a shorter prompt's row takes the shared adapter.  Measured at SmolLM2 8K against
    the calibrated adapter, in the same memory (its projections take reuse slots): perplexity within 0.001 on the
    calibration text and 1.020 -> 1.009 on other text, KL to full a fifth lower, 3-11 % fewer bytes read a step.

    ``klr_dtype`` "int8" stores each projected key as int8 with its own absmax scale (half of bf16's
    bytes, so a lower sigma in the same memory); "int4" packs two 4-bit elements a byte (twice int8's rank in its
    bytes).  Projections and scores compute in float32: rounded once, to the stored format, the same keys give the
    same rows and picks on a CPU and a GPU (a bf16 matmul rounds its output by device-specific rules, and bf16 scores
    tie at the top-M boundary).  Integer rows meet their queries rounded to int8 (``integer_queries``): the dot
    products are integers, exact in any order, and the native scorer takes the int8 dot-product instructions."""

    def __init__(self, adapter: LowRankAdapter | None, rank: int, dims: ModelDims, batch: int, max_context: int,
                 group_tokens: int, picked_groups: int, predictor: PredictorConfig, device: torch.device,
                 scaling: float = 1.0, backend: Backend | None = None):
        """``predictor``: the config section it reads (klr_dtype, score_reduce); ``scaling`` the model's 1/sqrt(d);
        ``backend``: what it scores on (runtime/kernels.py; None: the device's own)."""
        n_kv_heads, head_dim, n_layers = dims.n_kv_heads, dims.head_dim, dims.n_layers
        self.score_reduce = predictor.score_reduce
        self.scaling = scaling
        self.G = group_tokens
        self.picked_groups = picked_groups
        self.max_groups = -(-max_context // group_tokens)
        self._group_scores = torch.empty(batch, self.max_groups, device=device)  # reused every select
        self._scratch = torch.empty(0)  # the native scorer's logits of a select (shared or on the caller), grown once
        self._posted_scratch: list[torch.Tensor] = []  # scratches of posted jobs whose picks were taken, for reuse
        self._outside_key, self._outside_mask = None, None  # (first, counts) -> the groups no row may pick
        stored, self.bits, scale_bytes = KLR_FORMATS[predictor.klr_dtype]
        self.quantized = scale_bytes > 0
        self.dtype = torch.float32  # what projections and scores compute in
        self.device = device
        self.rank = rank
        self.n_kv_heads = n_kv_heads
        self.head_dim = head_dim
        self.adapter = [None] * n_layers if adapter is None else [a.to(device, self.dtype).contiguous()
                                                                  for a in adapter.matrices]
        self._stacked: torch.Tensor | None = None  # the adapters [L, H_kv * d, rank], once every layer has one
        # prompt_adapter: each row's projections [L, B, H_kv * d, rank] (its own, or a copy of the shared one)
        self.rows_adapter = torch.zeros(n_layers, batch, n_kv_heads * head_dim, rank, device=device) \
            if predictor.prompt_adapter else None
        # in blocks of KLR_BLOCK_TOKENS tokens, rank-major within one: a token's row is a column, so scoring runs along
        # the tokens (a query element times a stretch of tokens, no sum across a row); int4 packs two consecutive rank
        # positions a byte
        width = -(-rank * self.bits // stored.itemsize // 8)
        self.k_lr = torch.zeros(n_layers, batch, klr_blocks(max_context), width, KLR_BLOCK_TOKENS, dtype=stored,
                                device=device)
        self.k_scale = torch.zeros(n_layers, batch, max_context if self.quantized else 0, dtype=torch.bfloat16, device=device)
        self.resident_bytes = sum(t.numel() * t.element_size() for t in (self.k_lr, self.k_scale, self.rows_adapter)
                                  if t is not None)
        self.fitted_on = [0] * n_layers
        self._unfitted: list[list[tuple[int, int, torch.Tensor]]] = [[] for _ in range(n_layers)]
        self._row_fitted = np.zeros((n_layers, batch), dtype=bool)  # prompt_adapter: a row's projection is set
        self._choose_kernels(backend or resolve_backend(device), predictor.klr_dtype, dims.n_heads)

    uses_adapter = True

    @classmethod
    def for_batch(cls, adapter, rank, dims, batch, cfg, backend, scaling):
        """The selector of a batch run with ``cfg`` (the policy's effective config) on ``backend``."""
        return cls(adapter, rank, dims, batch, cfg.max_context, cfg.G, cfg.picked_groups, cfg.predictor,
                   backend.device, scaling, backend)

    def _choose_kernels(self, backend: Backend, klr_dtype: str, n_heads: int) -> None:
        """Each operation's implementation, from the backend and the shapes this selector is built for: the top-M
        natively where the backend has the scorer's library, the queries' projection where the rank fits it too, the
        scores where it also reads the rows' format; else torch's (``scorer_fallback`` says why, once, on a CPU)."""
        lib = self._native = backend.lib("score")
        projects = lib is not None and self.rank <= lib.max_rank
        self._scorer, self._rows_kind, self._why_torch = None, NATIVE_ROWS.get(klr_dtype), None
        if backend.device.type == "cpu":
            self._why_torch = self._scorer_refusal(backend, lib, n_heads)
            self._scorer = lib if self._why_torch is None else None
        if self._scorer is not None:  # each layer's rows and scales as its jobs take them: addresses, byte strides
            item, quantized = self.k_lr.element_size(), self.quantized
            self._rows_args = [(rows.data_ptr(), rows.stride(1) * item, rows.stride(0) * item,
                                scales.data_ptr() if quantized else None, scales.stride(0) if quantized else 0)
                               for rows, scales in zip(self.k_lr, self.k_scale)]
        self._low_rank_queries = self._native_queries if projects else self._torch_queries
        self._score_groups = self._native_group_scores if self._scorer is not None else self._torch_group_scores
        self._top = self._native_top if lib is not None else self._torch_top
        self._launch = self._launch_native if self._scorer is not None else super().launch

    def _scorer_refusal(self, backend: Backend, lib, n_heads: int) -> str | None:
        """Why a CPU select on ``backend`` scores through torch (no native library, a row format, rank or head count
        the scorer does not take), or None: the native scorer serves."""
        if lib is None:
            return f"the {backend.name} backend ({backend.reason}): scored through torch"
        queries = n_heads if self.score_reduce == "softmax" else 1
        if self._rows_kind is None:
            why = f"{self.k_lr.dtype} K_lr rows"
        elif self.rank > lib.max_rank:
            why = f"rank {self.rank} > {lib.max_rank}"
        elif queries > lib.max_queries:
            why = f"{queries} queries a sequence > {lib.max_queries}"
        elif lib.block_tokens != KLR_BLOCK_TOKENS:
            why = (f"the native K_lr scorer reads blocks of {lib.block_tokens} tokens where K_lr is stored in blocks "
                   f"of {KLR_BLOCK_TOKENS}; rebuild it (edgekv build-native)")
        else:
            return None
        return f"{why}: scored through torch"

    def fitted_adapter(self) -> tuple[LowRankAdapter | None, int]:
        """The projections fitted here (None if some layer had no keys) and the fewest keys a layer's fit saw."""
        if any(a is None for a in self.adapter):
            return None, 0
        return LowRankAdapter([a.float().cpu() for a in self.adapter], self.n_kv_heads, self.head_dim), min(self.fitted_on)

    def append(self, layer, seq, first_token, k):
        if k.shape[1] == 0:
            return
        flat = k.transpose(0, 1).reshape(k.shape[1], -1)
        if self.rows_adapter is not None and first_token == 0:  # a prompt: its row's projection for this layer
            self._adapt_row(layer, seq, flat)
        if self._projection(layer, seq) is None:
            self._unfitted[layer].append((seq, first_token, flat))
            return
        self._store(layer, seq, first_token, flat)

    def _adapt_row(self, layer: int, seq: int, flat: torch.Tensor) -> None:
        """A row's projection for ``layer`` from its prompt's keys ``flat`` [T, H_kv * d]: fitted on them where they are
        enough for a stable fit, else the shared adapter's (copied when it is known: ``_fit`` copies it otherwise)."""
        own = flat.shape[0] >= KEYS_PER_RANK * self.rank
        self._row_fitted[layer, seq] = own or self.adapter[layer] is not None
        if own:
            self.rows_adapter[layer, seq] = self._fitted(flat)
        elif self.adapter[layer] is not None:
            self.rows_adapter[layer, seq] = self.adapter[layer]

    def _fitted(self, keys: torch.Tensor) -> torch.Tensor:
        """The projection [H_kv * d, rank] fitted on ``keys`` [N, H_kv * d] (LowRankAdapter.fit), as the rows use it."""
        return LowRankAdapter.fit([keys], self.n_kv_heads, self.head_dim, self.rank).matrices[0].to(
            self.device, self.dtype).contiguous()

    def _projection(self, layer: int, seq: int) -> torch.Tensor | None:
        """The projection [H_kv * d, rank] ``seq``'s keys of ``layer`` are stored through, or None (not fitted yet)."""
        if self.rows_adapter is None:
            return self.adapter[layer]
        return self.rows_adapter[layer, seq] if self._row_fitted[layer, seq] else None

    def _query_adapters(self, layer: int) -> tuple[torch.Tensor, int]:
        """The projections a layer's queries take and the floats from one row's to the next: the shared one (0), or
        each row's own (prompt_adapter)."""
        if self.rows_adapter is None:
            return self.adapter[layer], 0
        rows = self.rows_adapter[layer]
        return rows, rows.stride(0)

    def append_layers(self, seq, first_token, k):
        """Every layer's keys projected in one batched matmul and stored in one write (a flush of SmolLM2's 30 layers:
        one call instead of thirty chains of a dozen)."""
        if self.rows_adapter is not None:
            if k.shape[2] == 0 or first_token == 0 or not self._row_fitted[:, seq].all():
                return super().append_layers(seq, first_token, k)
            return self._store(slice(None), seq, first_token, k.transpose(1, 2).flatten(2), self.rows_adapter[:, seq])
        if k.shape[2] == 0 or any(a is None for a in self.adapter):
            return super().append_layers(seq, first_token, k)
        if self._stacked is None:
            self._stacked = torch.stack(self.adapter)
        self._store(slice(None), seq, first_token, k.transpose(1, 2).flatten(2), self._stacked)

    def _store(self, layer: int | slice, seq: int, first_token: int, flat: torch.Tensor,
               adapter: torch.Tensor | None = None) -> None:
        """Project ``flat`` [..., T, H_kv * d] (a leading layer dimension where ``layer`` is a slice, ``adapter``
        then the layers' stacked projections) and store the rows from ``first_token``."""
        rows = slice(first_token, first_token + flat.shape[-2])
        projected = flat.to(self.dtype) @ (self._projection(layer, seq) if adapter is None else adapter)
        token = torch.arange(rows.start, rows.stop, device=self.device)
        # [..., T, width] in at each token's block and column: the token's index leads where the indices straddle
        # the rows' dimension
        at = (layer, seq, token // KLR_BLOCK_TOKENS, slice(None), token % KLR_BLOCK_TOKENS)
        if not self.quantized:
            self.k_lr[at] = projected.movedim(-2, 0).to(self.k_lr.dtype)
            return
        levels = INT_LEVELS[self.bits]
        scale = projected.float().abs().amax(dim=-1).clamp_min(1e-12) / levels
        q = (projected.float() / scale[..., None]).round().clamp_(-levels - 1, levels)
        self.k_lr[at] = (q.to(torch.int8) if self.bits == 8 else _pack_nibbles(q)).movedim(-2, 0)
        self.k_scale[layer, seq, rows] = scale.to(torch.bfloat16)

    def end_prefill(self) -> None:
        for layer in range(len(self.adapter)):
            self._fit(layer)

    def _fit(self, layer: int) -> None:
        """Fit the layer's shared projection on every key waiting for it (rows without their own), then project them."""
        waiting, self._unfitted[layer] = self._unfitted[layer], []
        if not waiting:
            return
        if self.adapter[layer] is None:
            keys = torch.cat([flat for _, _, flat in waiting])
            self.adapter[layer] = self._fitted(keys)
            self._stacked = None
            self.fitted_on[layer] = keys.shape[0]
        for seq, first_token, flat in waiting:
            if self.rows_adapter is not None and not self._row_fitted[layer, seq]:
                self.rows_adapter[layer, seq] = self.adapter[layer]
                self._row_fitted[layer, seq] = True
            self._store(layer, seq, first_token, flat)

    def token_scores(self, layer: int, q: torch.Tensor, n_tokens: int, row_tokens: np.ndarray | None = None
                     ) -> torch.Tensor:
        """Approximate attention, [B, n_tokens]: logits summed over heads ("sum", KVSwap), or each
        head's softmax summed ("softmax": every head gets one vote, whatever its logit scale).  ``row_tokens`` [B]:
        each row's own tokens, the span of its softmax (zero votes past it), so a row's votes are the bits it gets
        alone whatever the rows beside it hold; None: every row has ``n_tokens``."""
        scores = self._times_rows(layer, n_tokens, self._low_rank_queries(layer, q))
        if self.score_reduce == "sum":
            return scores[:, 0]
        if row_tokens is None or (row_tokens == n_tokens).all():
            return scores.softmax(dim=-1).sum(dim=1)
        votes = scores.new_zeros(scores.shape[0], n_tokens)
        for n in np.unique(row_tokens):  # a softmax over exactly its tokens: padded, its sums would round otherwise
            rows = torch.from_numpy(np.flatnonzero(row_tokens == n)).to(scores.device)
            votes[rows, :n] = scores[rows, :, :n].softmax(dim=-1).sum(dim=1)
        return votes

    def _native_queries(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """``_low_rank_queries`` in one native call (ekv_score.c), whichever path scores them, q widened to float32
        first."""
        b, h, _, d = q.shape
        if q.dtype != torch.float32 or not q.is_contiguous():
            q = q.float().contiguous()
        summed = self.score_reduce == "sum"
        out = torch.empty(b, 1 if summed else h, self.rank)
        adapter, seq_stride = self._query_adapters(layer)
        if self._native.ekv_low_rank_queries(q.data_ptr(), b, h, self.n_kv_heads, d, adapter.data_ptr(), seq_stride,
                                             self.rank, self.scaling, int(summed), out.data_ptr()):
            raise RuntimeError(f"the native projection refused rank {self.rank} or {h} heads over {self.n_kv_heads}")
        return out

    def _torch_queries(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """The queries q [B, H, 1, d] projected to rank r, float32 [B, c, r]: one summed query ("sum": summing over
        heads commutes with the projection), or every head's, scaled as attention scales it ("softmax")."""
        b, h, _, d = q.shape
        grouped = q.reshape(b, self.n_kv_heads, h // self.n_kv_heads, d)
        adapter, seq_stride = self._query_adapters(layer)
        # [(B,) H_kv, d, r]: one for the batch, or each row's own
        adapter = adapter[:b].view(b, self.n_kv_heads, d, -1) if seq_stride else adapter.view(self.n_kv_heads, d, -1)
        if self.score_reduce == "sum":
            return torch.einsum(f"bgd,{'b' if seq_stride else ''}gdr->br", grouped.sum(dim=2).to(self.dtype),
                                adapter)[:, None, :]
        # a broadcast matmul, not einsum: the same product at half the dispatch (24 against 48 us, SmolLM2's shapes)
        return torch.matmul(grouped.to(self.dtype), adapter).reshape(b, h, -1) * self.scaling

    def _times_rows(self, layer: int, n_tokens: int, lhs: torch.Tensor) -> torch.Tensor:
        """``lhs`` [B, c, r] times the layer's first ``n_tokens`` K_lr rows in float32 -> [B, c, n_tokens]; integer
        rows against ``lhs`` rounded to int8, the integer products times the query's and the token's scales (the torch
        path: a CPU selection calls the native scorer where it serves).  The queries on the left and the tokens last:
        a softmax over tokens then runs on contiguous memory, and on a CPU this order was 1-4x faster than the rows
        times the queries (one thread, SmolLM2's shapes, 8K: 0.22 against 0.83 ms for 9 heads at rank 96, batch 1;
        0.50 against 1.73 ms for one summed query at batch 4).  On a CPU the rows are converted some blocks at a time
        (a whole float copy is fresh memory every select: at 4 x 32K its page faults tripled the select's time), on a
        GPU at once (one kernel; its allocator reuses the memory)."""
        blocks = self.k_lr[layer, :, : klr_blocks(n_tokens)]  # [B, blocks, stored width, KLR_BLOCK_TOKENS]
        batch, n_blocks = blocks.shape[:2]
        if self.quantized:
            codes, q_scale = integer_queries(lhs)
            lhs = codes.to(self.dtype)
        step = max(4, CPU_BLOCK_BYTES // (4 * batch * self.rank * KLR_BLOCK_TOKENS)) if blocks.device.type == "cpu" \
            else n_blocks
        out = torch.empty(batch, lhs.shape[1], n_blocks, KLR_BLOCK_TOKENS, dtype=self.dtype, device=blocks.device)
        for start in range(0, n_blocks, step):
            part = torch.matmul(lhs[:, None], self._as_float(blocks[:, start : start + step]))  # [B, n, c, tokens]
            out[:, :, start : start + step] = part.transpose(1, 2)
        out = out.flatten(2)[..., :n_tokens]
        if self.quantized:  # the query's and the token's scales factor out of the integer dot product
            out.mul_(q_scale[:, :, None] * self.k_scale[layer, :, None, :n_tokens])
        return out

    def _as_float(self, rows: torch.Tensor) -> torch.Tensor:
        """Stored K_lr rows [..., stored width, tokens] (a block's, or blocks') as float32 [..., rank, tokens] (int4:
        the nibbles unpacked, unscaled)."""
        if self.bits != 4:
            return rows.to(self.dtype)
        return torch.stack([rows & 15, rows >> 4], dim=-2).flatten(-3, -2)[..., : self.rank, :].to(self.dtype) - 8

    def select(self, layer, q, n_groups, first=0):
        self._fit(layer)
        counts = np.asarray(n_groups)
        max_groups, batch = int(counts.max(initial=0)), q.shape[0]
        if max_groups == 0:
            return (torch.zeros(batch, self.picked_groups, dtype=torch.long, device=q.device),
                    torch.zeros(batch, self.picked_groups, dtype=torch.bool, device=q.device))
        group_scores = self._group_scores[:batch]
        self._score_groups(layer, q, counts, group_scores)
        return self._top(group_scores, counts, first)

    def _torch_group_scores(self, layer: int, q: torch.Tensor, counts: np.ndarray, out: torch.Tensor) -> None:
        """Each group's score into ``out[:, :max(counts)]``: its tokens' ``token_scores`` over each row's own
        ``counts[b]`` groups, their maximum."""
        max_groups = int(counts.max())
        scores = self.token_scores(layer, q, max_groups * self.G, counts.astype(np.int64) * self.G)
        out[:, :max_groups] = scores.view(out.shape[0], max_groups, self.G).amax(dim=-1)

    def launch(self, layer, q, n_groups, first=0):
        return self._launch(layer, q, n_groups, first)

    def _launch_native(self, layer: int, q: torch.Tensor, n_groups, first: int) -> "Picking":
        """With the policy's helper thread lent, the native scorer's job and then the top-M's are posted to it and the
        caller goes on; without, the picks are made now."""
        self._fit(layer)
        counts = np.asarray(n_groups)
        max_groups = int(counts.max(initial=0))
        if self.aside is None or not max_groups:
            return super().launch(layer, q, n_groups, first)
        posted = self._launch_posted(layer, q, counts, max_groups, first)
        if posted is not None:
            return posted
        out = torch.empty(q.shape[0], self.max_groups)
        scratch = self._posted_scratch.pop() if self._posted_scratch else torch.empty(0)
        job = self._native_job(layer, q, counts, out, scratch)
        # the helper runs posted jobs in order: a phase's units after the last one's, then the top-M's (the caller
        # only reads the picks)
        jobs, keep = [(fn, job.buffer, job.units) for fn in job.phases], job.keep
        lib, picks, kept_counts, args = self._top_call(out, counts, first)
        top_job = np.empty(lib.top_job_bytes, dtype=np.uint8)
        jobs.append((lib.top_unit, top_job, _top_units(lib.ekv_top_job(address(top_job), *args))))
        ticket = self.aside.post_chain(jobs, keep + (picks, kept_counts))

        def made() -> np.ndarray:
            self._posted_scratch.append(job.keep[1])
            return picks

        return ScoredAside(self.aside, ticket, made)

    def _launch_posted(self, layer: int, q: torch.Tensor, counts: np.ndarray, max_groups: int, first: int
                       ) -> "ScoredAside | None":
        """``launch``'s queries, scores' job and top-M's job made and posted to the helper in one native call
        (ekv_score.c ekv_score_launch); None once the helper is closed, and the calls one by one (which run on the
        caller then) take the launch."""
        post = self.aside.native_post()
        if post is None:
            return None
        lib, kind, row_args = self._scorer, self._rows_kind, self._rows_args[layer]
        adapter, seq_stride = self._query_adapters(layer)
        if q.dtype != torch.float32 or not q.is_contiguous():
            q = q.float().contiguous()
        batch, heads, _, head_dim = q.shape
        softmax = self.score_reduce == "softmax"
        n_queries, n_tokens = heads if softmax else 1, max_groups * self.G
        scratch = self._posted_scratch.pop() if self._posted_scratch else torch.empty(0)
        needed = lib.ekv_score_scratch_floats(batch, n_queries, n_tokens, self.G)
        if scratch.numel() < needed:
            scratch = torch.empty(needed)
        queries, out = torch.empty(batch, n_queries, self.rank), torch.empty(batch, self.max_groups)
        counts = np.ascontiguousarray(counts, dtype=np.int64)
        picks = np.empty((batch, self.picked_groups), dtype=np.int64)
        jobs = np.empty(lib.launch_bytes, dtype=np.uint8)
        ticket = lib.ekv_score_launch(
            address(jobs), *post, q.data_ptr(), batch, heads, self.n_kv_heads, head_dim, adapter.data_ptr(), seq_stride,
            self.rank, self.scaling, queries.data_ptr(), *row_args, kind, n_tokens, self.G, int(softmax),
            scratch.data_ptr(), scratch.numel(), out.data_ptr(), out.stride(0), address(counts), first,
            self.picked_groups, self.max_groups, address(picks))
        if ticket < 0:  # the selector's shapes were checked when it was built: a bug
            raise RuntimeError("the native launch refused its arguments (ekv_score.c ekv_score_launch)")
        self.aside.posted(ticket, (jobs, queries, scratch, out, counts, picks))

        def made() -> np.ndarray:
            self._posted_scratch.append(scratch)
            return picks

        return ScoredAside(self.aside, ticket, made)

    def _native_top(self, group_scores: torch.Tensor, counts: np.ndarray, first: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``_top`` in one native call (ekv_score.c ekv_top: ties to the lower group)."""
        lib, picks, _, args = self._top_call(group_scores, counts, first)
        _top_units(lib.ekv_top(*args))
        return _picked(picks)

    def _torch_top(self, group_scores: torch.Tensor, counts: np.ndarray, first: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """The top-M of each row's group scores [B, max_groups] among the groups ``first <= g < counts[b]``: torch's
        topk over every group a sequence can have, whatever the batch's longest (how topk breaks ties depends on the
        width, and a row's picks must depend on its own scores only, not on the rows beside it)."""
        batch = group_scores.shape[0]
        top = group_scores.masked_fill_(self._outside(counts, first), float("-inf")).topk(
            min(self.picked_groups, self.max_groups), dim=-1)
        groups, valid = top.indices, top.values > float("-inf")
        if groups.shape[1] < self.picked_groups:  # fewer groups than picks in the whole context
            short = self.picked_groups - groups.shape[1]
            groups = torch.cat([groups, groups.new_zeros(batch, short)], dim=1)
            valid = torch.cat([valid, valid.new_zeros(batch, short)], dim=1)
        return groups, valid

    def _top_call(self, group_scores: torch.Tensor, counts: np.ndarray, first: int
                  ) -> "tuple[object, np.ndarray, np.ndarray, tuple]":
        """(the scorer, the picks [B, M] it fills: best first, -1 past a row's candidates, the counts it reads, the
        top-M's arguments) for float32 scores [B, max_groups] with rows of contiguous groups (``_group_scores``)."""
        counts = np.ascontiguousarray(counts, dtype=np.int64)
        picks = np.empty((group_scores.shape[0], self.picked_groups), dtype=np.int64)
        return self._native, picks, counts, (group_scores.data_ptr(), group_scores.stride(0), group_scores.shape[0],
                                             address(counts), first, self.picked_groups, group_scores.shape[1],
                                             address(picks))

    def _native_group_scores(self, layer: int, q: torch.Tensor, counts: np.ndarray, out: torch.Tensor) -> None:
        """Each group's score into ``out[:, :max(counts)]`` by the native scorer, its parts shared with the helper
        thread where the policy lent one."""
        job = self._native_job(layer, q, counts, out, self._scratch)
        self._scratch = job.keep[1]
        for fn in job.phases:
            if self.aside is not None:
                self.aside.share(fn, job.buffer, job.units)
            else:
                run_units(fn, job.buffer, job.units)

    def _native_job(self, layer: int, q: torch.Tensor, counts: np.ndarray, out: torch.Tensor, scratch: torch.Tensor
                    ) -> "ScoreJob":
        """The native scorer's job (runtime/native/ekv_score.c: one pass over the rank-major rows, no float copy of
        them; units of a part of a sequence) for each group's score into ``out[:, :max(counts)]`` over ``scratch``
        (grown here where short: the job's ``keep[1]``); a row's softmax spans its own ``counts[b]`` groups."""
        lib = self._scorer
        counts = np.ascontiguousarray(counts, dtype=np.int64)
        n_tokens = int(counts.max()) * self.G
        queries = self._low_rank_queries(layer, q).contiguous()
        batch, n_queries = queries.shape[:2]
        needed = lib.ekv_score_scratch_floats(batch, n_queries, n_tokens, self.G)
        if scratch.numel() < needed:
            scratch = torch.empty(needed)
        softmax = self.score_reduce == "softmax"
        job = np.empty(lib.job_bytes, dtype=np.uint8)
        units = lib.ekv_score_job(address(job), *self._rows_args[layer], queries.data_ptr(), batch, n_queries,
                                  self.rank, n_tokens, self.G, self._rows_kind, int(softmax), address(counts),
                                  scratch.data_ptr(), scratch.numel(), out.data_ptr(), out.stride(0))
        if units < 0:  # the rows' format, rank and heads were checked when the selector was built: a bug
            raise RuntimeError("the native scorer refused its arguments (ekv_score.c ekv_score_job)")
        return ScoreJob(job, (queries, scratch, out, counts), units, lib.phases[softmax])

    def stats(self) -> dict:
        return {"scorer_fallback": self._why_torch}

    def _outside(self, counts: np.ndarray, first: int) -> torch.Tensor:
        """[B, max_groups] bool on the device: the groups a row may not pick (before ``first`` or at/after its count).
        The same for every layer of a step, so made on the host and moved once when the counts change."""
        key = (first, counts.dtype.str, counts.shape, counts.tobytes())
        if self._outside_key != key:
            index = np.arange(self.max_groups)
            outside = (index < first) | (index >= counts.astype(np.int64)[:, None])
            self._outside_mask, self._outside_key = to_device(outside, self.device), key
        return self._outside_mask


def _top_units(code: int) -> int:
    """The native top-M's return (units, or 0 once run); a refusal (-1: M under 1, ``first`` below 0, more groups
    than a row of scores) is a bug of its caller, never picks from an unwritten buffer."""
    if code < 0:
        raise RuntimeError("the native top-M refused its arguments (M < 1, first < 0 or max_groups > the scores' row)")
    return code


def _picked(picks: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """Native picks [B, M] (-1: none) as ``select`` gives them: groups (0 where none) and valid."""
    return torch.from_numpy(np.maximum(picks, 0)), torch.from_numpy(picks >= 0)


class ScoreJob(NamedTuple):
    """A native scoring job: its buffer, what it points into (the queries, the scratch, the scores), the units of each
    phase, and the phases' unit functions, each run to the end before the next starts."""

    buffer: np.ndarray
    keep: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    units: int
    phases: tuple[int, ...]


class Picked(NamedTuple):
    """Picks made: groups [B, M] and valid [B, M], as ``select`` returns them."""

    groups: torch.Tensor
    valid: torch.Tensor

    def ready(self) -> bool:
        return True

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.groups, self.valid


class ScoredAside:
    """Picks the helper thread is making (the group scores, then their top-M): ``result`` and ``host`` wait for them."""

    def __init__(self, aside: AsideThread, ticket: int, made: Callable[[], np.ndarray]):
        """``made``: the picks [B, M] (-1: none) once the job of ``ticket`` is done."""
        self.aside, self.ticket, self.made = aside, ticket, made

    def ready(self) -> bool:
        return self.aside.done(self.ticket)

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        return _picked(self.host())

    def host(self) -> np.ndarray:
        """The picks [B, M] on the host, -1 where none (no tensor made on the way)."""
        self.aside.wait(self.ticket)
        return self.made()


Picking = Picked | ScoredAside  # what ``Selector.launch`` returns


def integer_queries(lhs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Low-rank queries [..., r] float32 rounded to int8 for integer K_lr rows, as ekv_score.c round_queries rounds
    them: each query's scale is its largest magnitude over 127 (at least the smallest normal float), its elements
    divided by it and rounded half to even.  Returns (codes int8 [..., r], scales float32 [...]).  An element moves
    by at most half of 1/127 of the query's largest: far finer than a 4-bit row's 16 steps."""
    levels = INT_LEVELS[8]
    scale = (lhs.abs().amax(dim=-1) / levels).clamp_min(torch.finfo(torch.float32).tiny)
    return (lhs / scale[..., None]).round().clamp_(-levels, levels).to(torch.int8), scale


def _pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """Integers in [-8, 7], [n, rank] -> uint8 [n, ceil(rank / 2)]: two a byte, offset by 8, low nibble first."""
    u = (q + 8).to(torch.uint8)
    if u.shape[-1] % 2:
        u = torch.cat([u, torch.full_like(u[..., :1], 8)], dim=-1)
    return u[..., 0::2] | (u[..., 1::2] << 4)


class OracleSelector(LowRankSelector):
    """Scores with the layer's own query at attention time instead of predicting it a layer ahead: a quality
    ceiling for ablations (with sigma=1 and score_reduce "softmax" it is top-k by true attention); its reads
    are not overlapped."""

    reads_ahead = False


SELECTORS = {"lowrank": LowRankSelector, "oracle": OracleSelector, "random": RandomSelector}  # config 'selector'
