"""ARKV (tri-state KV under a memory budget): each cached token is original, quantized or evicted.

Prefill: per layer, the attention of the last W prompt queries (the observation window) gives the
layer's OQ score q_l = H^(1/tau1) V^(1/tau2) K^(1/tau3) (entropy, variance, kurtosis of the attention
mass p_k over the tokens outside the window) and ρ_l = q_l / max q: the share of a layer's kept tokens
held in original precision (a more concentrated, sensitive layer keeps more).  It also seeds each
token's heavy-hitter statistics.  Decode: every step updates, per token, smoothed mean and mean square
of its attention over KV heads (query heads averaged within their group) and queries; the score is
S = mean + gamma * variance.  When the original slots are full, the tailor ranks the tokens outside
the protected window: the best ``keep_o`` originals stay original, the next ones are quantized (with
the quantized tokens already held), the rest are evicted.  States only go down: a quantized token is
never restored.  The slack (``arkv_slack``) leaves free original slots so tailoring runs every few dozen steps.

Memory: one preallocated byte arena per layer and sequence, max_kv_mem_mib / (max_batch * layers).
Original slots grow from its start (K, V and the token's position and statistics per record) and
quantized groups (runtime/qattn.py GroupLayout) from its end, so ρ picks the split without moving
data.  With no budget, or one that holds every token of max_context in original precision, the
engine serves arkv with ``InMemoryKV`` (exactly ``full``).

Where ρ comes from: prefill hands the policy each layer's queries (``observe_prompt``) before its KV;
ρ_l is provisional (over the layers seen so far) at ``store_prompt`` and final at ``end_prompt``,
where a layer whose ρ fell demotes originals (downward, as always).  KV without queries (a stored
context, a prompt-cache entry kept without them) gets ρ = FALLBACK_RHO everywhere and no prompt
statistics: until decode steps score the prompt, ties keep the most recent tokens.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from .config import ConfigError, RuntimeConfig
from .kv_policy import KVPolicy
from .model import DecoderModel, ModelDims
from .kernels import Backend, resolve_backend
from .qattn import GroupLayout, align16, batch_group_scores, batch_group_values, group_kernels
from .quant import Quantized, quant_format, quantize_keys, quantize_values
from .transfer import to_device

GROUP_TOKENS = 32  # tokens per quantized key group (scales per channel over the group)
TAU = (7.774, 5.407, 5.528)  # the paper's tuned temperatures for entropy, variance, kurtosis (Eq. 6)
FALLBACK_RHO = 0.5  # ρ of every layer when the prompt's queries are unknown
META_BYTES = 16  # per original record: position int32, then observations, mean, mean square (float32)


class ArkvGeometry:
    """Sizes shared by the memory plan and the policy: the arena per layer and sequence and its split for a ρ."""

    def __init__(self, cfg: RuntimeConfig, dims: ModelDims, itemsize: int):
        self.window, self.slack, self.max_context = cfg.arkv.arkv_window_tokens, cfg.arkv.arkv_slack, cfg.max_context
        self.kv_bytes = dims.n_kv_heads * dims.head_dim * itemsize  # one token's K (or V) of one layer
        self.meta_offset = align16(2 * self.kv_bytes)
        self.original_bytes = self.meta_offset + META_BYTES
        self.full_bytes = cfg.max_context * 2 * self.kv_bytes  # `full`'s KV of one layer and sequence
        budget = None if cfg.max_kv_mem_mib is None else cfg.max_kv_mem_mib * 2**20 / (cfg.max_batch * dims.n_layers)
        self.fits_all = budget is None or budget >= self.full_bytes
        self.arena_bytes = 0 if self.fits_all else int(budget) // 16 * 16
        self.window_bytes = (self.window + 1) * self.original_bytes
        try:
            formats = ("int8", "int4") if cfg.arkv.arkv_quant == "auto" else (cfg.arkv.arkv_quant,)
            layouts = [GroupLayout(dims.n_kv_heads, GROUP_TOKENS, dims.head_dim, quant_format(f)) for f in formats]
        except ValueError as exc:
            raise ConfigError(f"config field 'arkv_quant' {cfg.arkv.arkv_quant!r}: {exc}; use int8") from exc
        # auto: int8 while a copy of every token fits in it, else int4 (evicting costs more than 4 bits:
        # fixture at 1/4, int8 evicting 0.912 relative accuracy, int4 keeping every token 1.000)
        self.layout = next((lay for lay in layouts if self._holds_every_token(lay)), layouts[-1])
        self.min_arena_bytes = self.window_bytes + GROUP_TOKENS * self.original_bytes + self.layout.record_bytes
        self.max_original = self.arena_bytes // self.original_bytes
        self.max_groups = self.arena_bytes // self.layout.record_bytes

    def _holds_every_token(self, layout: GroupLayout) -> bool:
        n = max(0, self.max_context - self.window)
        groups = -(-n // GROUP_TOKENS) + 1
        return groups * layout.record_bytes + self.window_bytes + GROUP_TOKENS * self.original_bytes <= self.arena_bytes

    def capacity(self, rho: float, n_tokens: int, min_groups: int = 0) -> tuple[int, int, int]:
        """(original slots, quantized groups, originals kept outside the window after a tailor) for ρ when the
        sequence holds ``n_tokens``.

        Quantize only as the budget requires, and evict only when a quantized copy of every token does not fit:
        an evicted token costs more than a quantized one (Eq. 8 read in bytes, ρ n originals and the rest
        quantized, evicted half the tokens of the top layer at a budget that holds every token in int8: fixture
        relative accuracy 0.77 at 1/2).  So: every token original while they fit with their slack; else a
        quantized copy of every token first and the bytes left buy originals, at most ρ n (the layer's OQ ratio
        decides how many stay exact); else the lowest-scored are evicted, only the window and one group of
        slack staying original.  Slack: n_o (1 - α) / α original slots (at least a group) that new tokens fill
        between tailors.  The split follows the sequence as it grows; quantized groups never shrink.
        """
        c_o, c_g, a = self.original_bytes, self.layout.record_bytes, self.slack
        c_q = c_g / GROUP_TOKENS
        n = max(0, n_tokens - self.window)
        free = self.arena_bytes - self.window_bytes - GROUP_TOKENS * c_o  # the window and the least slack
        slack_per_token = (1 - a) / a
        if n * c_o + max(0.0, n * slack_per_token - GROUP_TOKENS) * c_o <= free - min_groups * c_g:
            keep = n
        elif n * c_q + c_g <= free:  # one group more: groups come whole
            room = free - c_g - n * c_q
            keep = int(min(rho * n, room / (c_o - c_q)))
            if keep * slack_per_token > GROUP_TOKENS:  # slack beyond one group, paid per original
                keep = int(min(rho * n, (room + GROUP_TOKENS * c_o) / (c_o * (1 + slack_per_token) - c_q)))
        else:
            keep = 0
        slack = max(GROUP_TOKENS, math.ceil(keep * slack_per_token))
        slots = min(self.window + 1 + keep + slack, self.max_original)
        groups = max((self.arena_bytes - slots * c_o) // c_g, min_groups)
        slots = min(slots, (self.arena_bytes - groups * c_g) // c_o)
        keep = max(0, min(keep, slots - self.window - 1 - slack))
        return slots, groups, keep


def oq_score(p: torch.Tensor) -> float:
    """q_l of attention mass p over the evictable tokens (Eq. 3-6); 0 for a flat distribution."""
    p = p / p.sum()
    entropy = -torch.special.xlogy(p, p).sum()
    dev = p - p.mean()
    var = (dev * dev).mean()
    if var <= 0:
        return 0.0
    kurtosis = (dev**4).mean() / var**2
    return float(entropy ** (1 / TAU[0]) * var ** (1 / TAU[1]) * kurtosis ** (1 / TAU[2]))


def prompt_statistics(q_obs: torch.Tensor, k: torch.Tensor, scaling: float, window: int):
    """Observation-window attention of q_obs [H, W, d] over the prompt's keys k [H_kv, T, d]: per token
    (observations, mean, mean square) [T, 3] over KV heads (query heads averaged per group) and queries,
    and the layer's OQ score (None with fewer than 2 tokens outside the window).  One KV head at a time."""
    n_heads, n_obs, _ = q_obs.shape
    n_kv, T, _ = k.shape
    rep = n_heads // n_kv
    hidden = torch.arange(T, device=k.device)[None] > torch.arange(T - n_obs, T, device=k.device)[:, None]
    mass, mean, square = (torch.zeros(T, device=k.device) for _ in range(3))
    for h in range(n_kv):
        s = (q_obs[h * rep: (h + 1) * rep].float() @ k[h].float().T) * scaling
        a = s.masked_fill(hidden, float("-inf")).softmax(-1)  # [rep, W, T]
        mass += a.sum((0, 1))
        grouped = a.mean(0)
        mean += grouped.sum(0)
        square += (grouped * grouped).sum(0)
    stats = torch.stack((torch.full_like(mean, n_obs), mean / (n_kv * n_obs), square / (n_kv * n_obs)), dim=1)
    evictable = T - window
    return stats, (oq_score(mass[:evictable]) if evictable >= 2 else None)


def _flat_index(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(owner, index within it) of every item when owner i has ``counts[i]``: [0 0 1] [0 1 0] for counts [2, 1]."""
    owners = np.repeat(np.arange(len(counts)), counts)
    return owners, np.arange(len(owners)) - np.repeat(np.cumsum(counts) - counts, counts)


def _rank(score: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Indices best first: highest score, ties to the most recent token."""
    recent = torch.argsort(pos, descending=True)
    return recent[torch.sort(score[recent], descending=True, stable=True).indices]


class ArkvKV(KVPolicy):
    """The tri-state cache; attention spans original, quantized and window tokens in one softmax."""

    def __init__(self, model: DecoderModel, batch: int, cfg: RuntimeConfig, backend: Backend | None = None):
        """``backend``: what a sequence's quantized groups are attended on (runtime/kernels.py; None: the model
        device's)."""
        super().__init__(model, batch, cfg.max_context)
        self.quant_attention = group_kernels(backend or resolve_backend(model.device))
        d = model.dims
        self.geo = geo = ArkvGeometry(cfg, d, torch.empty(0, dtype=model.dtype).element_size())
        if geo.fits_all or geo.arena_bytes < geo.min_arena_bytes:
            raise ValueError("ArkvKV needs a budget between its minimum and the full cache; see runtime.memory.plan_memory")
        self.window, self.gamma = cfg.arkv.arkv_window_tokens, cfg.arkv.arkv_gamma
        self.n_kv, self.rep, self.head_dim = d.n_kv_heads, d.n_heads // d.n_kv_heads, d.head_dim
        self.arena = torch.zeros(d.n_layers, batch, geo.arena_bytes, dtype=torch.uint8, device=model.device)
        shape = (d.n_layers, batch)
        self.n_original, self.slots, self.keep_original = (np.zeros(shape, dtype=np.int64) for _ in range(3))
        self.groups, self.ready = np.zeros(shape, dtype=np.int64), np.zeros(shape, dtype=np.int64)
        self.feature = np.full(shape, np.nan)  # OQ scores q_l; nan: no queries seen
        self.rho = np.full(shape, FALLBACK_RHO)
        self.tailors = np.zeros(shape, dtype=np.int64)
        self._queries: dict[tuple[int, int], torch.Tensor] = {}
        self._originals = [[self._original_fields(self.arena[l, s]) for s in range(batch)] for l in range(d.n_layers)]
        self._rows = [[self.arena[l, s, geo.arena_bytes - geo.max_groups * geo.layout.record_bytes:]
                       .view(geo.max_groups, geo.layout.record_bytes) for s in range(batch)] for l in range(d.n_layers)]
        self._group_fields = [[geo.layout.fields(rows) for rows in layer] for layer in self._rows]
        # every sequence of a layer at once (the same offsets in each arena): a GPU attends the batch in one pass
        self.batched = model.device.type == "cuda"
        self._batch_originals = [self._original_fields(self.arena[l]) for l in range(d.n_layers)]
        self._batch_rows = [self.arena[l, :, geo.arena_bytes - geo.max_groups * geo.layout.record_bytes:]
                            .view(batch, geo.max_groups, geo.layout.record_bytes) for l in range(d.n_layers)]
        self._batch_index = torch.arange(batch, device=model.device)

    @property
    def prompt_queries(self) -> int:
        return self.window

    @property
    def resident_bytes(self) -> int:
        return self.arena.numel()

    def _original_fields(self, arena: torch.Tensor):
        """K, V [..., n, H_kv, d] and position [..., n], statistics [..., n, 3] views of the original records of
        ``arena`` [..., arena_bytes] (one sequence's, or a layer's batch)."""
        g, dtype, lead = self.geo, self.model.dtype, arena.shape[:-1]
        rows = arena[..., : g.max_original * g.original_bytes].view(*lead, g.max_original, g.original_bytes)
        kv = lambda a: rows[..., a: a + g.kv_bytes].view(dtype).view(*lead, -1, self.n_kv, self.head_dim)  # noqa: E731
        meta = rows[..., g.meta_offset: g.meta_offset + META_BYTES]
        return kv(0), kv(g.kv_bytes), meta[..., :4].view(torch.int32)[..., 0], meta[..., 4:].view(torch.float32)

    # ---- prefill ------------------------------------------------------------------------------

    def start_sequence(self, seq: int) -> None:
        super().start_sequence(seq)
        for a in (self.n_original, self.slots, self.keep_original, self.groups, self.ready, self.tailors):
            a[:, seq] = 0
        self.feature[:, seq] = np.nan

    def observe_prompt(self, layer: int, seq: int, q: torch.Tensor) -> None:
        """The prompt's queries q [H, T, d] of ``layer``, before its KV: the last W form the observation window."""
        self._queries[(layer, seq)] = q[:, -self.window:].clone()

    def store_prompt(self, layer, seq, k, v):
        T = k.shape[1]
        q_obs = self._queries.pop((layer, seq), None)
        if q_obs is not None:
            stats, feature = prompt_statistics(q_obs, k, self.model.scaling, self.window)
            self.feature[layer, seq] = np.nan if feature is None else feature
        else:
            stats = torch.zeros(T, 3, device=k.device)
        self._resize(layer, seq, self._rho(seq, layer + 1)[layer], T)
        pos = torch.arange(T, device=k.device)
        self._admit(layer, seq, T, (k.transpose(0, 1), v.transpose(0, 1), pos, stats))

    def end_prompt(self, seq: int, n_tokens: int) -> None:
        """ρ is final once every layer is seen: layers whose share of originals fell demote theirs."""
        super().end_prompt(seq, n_tokens)
        rho = self._rho(seq, self.model.dims.n_layers)
        for layer, r in enumerate(rho):
            self._resize(layer, seq, r, n_tokens)
            n = int(self.n_original[layer, seq])
            self._admit(layer, seq, n_tokens, self._live_originals(layer, seq, n))

    def _rho(self, seq: int, n_layers: int) -> np.ndarray:
        f = self.feature[:n_layers, seq]
        top = np.nanmax(f) if not np.isnan(f).all() else 0.0
        if top <= 0:
            return np.full(n_layers, FALLBACK_RHO)
        return np.nan_to_num(f / top, nan=1.0)

    def _resize(self, layer: int, seq: int, rho: float, n_tokens: int) -> None:
        """The split for ρ at ``n_tokens``; quantized groups never shrink (their tokens only go down)."""
        slots, groups, keep = self.geo.capacity(float(rho), n_tokens, int(self.ready[layer, seq]))
        self.slots[layer, seq], self.groups[layer, seq], self.keep_original[layer, seq] = slots, groups, keep
        self.rho[layer, seq] = rho

    def _admit(self, layer: int, seq: int, next_pos: int, tokens) -> None:
        """Keep candidate originals (k, v [n, H_kv, d], pos [n], stats [n, 3]), tailoring when they leave no free slot."""
        if len(tokens[2]) < self.slots[layer, seq]:
            self._activate_groups(layer, seq)
            K, V, P, S = self._originals[layer][seq]
            n = len(tokens[2])
            for dest, src in zip((K, V, P, S), tokens):
                dest[:n] = src
            self.n_original[layer, seq] = n
        else:
            self._tailor(layer, seq, next_pos, tokens)

    def _live_originals(self, layer: int, seq: int, n: int):
        K, V, P, S = self._originals[layer][seq]
        return K[:n], V[:n], P[:n].long(), S[:n]

    def _activate_groups(self, layer: int, seq: int) -> None:
        """Group rows the split added become free groups (their bytes may have held originals: call after reading them)."""
        ready, groups = int(self.ready[layer, seq]), int(self.groups[layer, seq])
        if groups > ready:
            rows = self._rows[layer][seq]
            fresh = slice(rows.shape[0] - groups, rows.shape[0] - ready)
            rows[fresh] = 0
            self._group_fields[layer][seq]["pos"][fresh] = -1
            self.ready[layer, seq] = groups

    # ---- decode -------------------------------------------------------------------------------

    def attend(self, layer, q, k, v):
        """One sequence at a time on a CPU (the quantized groups through the C kernel); the batch in one pass on a
        GPU, where a loop per sequence would be a few dozen launches each."""
        for seq in range(q.shape[0]):
            self._make_room(layer, seq)
        if self.batched:
            return self._attend_batch(layer, q, k[:, :, 0], v[:, :, 0])
        out = torch.empty_like(q)
        for seq in range(q.shape[0]):
            out[seq] = self._attend_one(layer, seq, q[seq], k[seq, :, 0], v[seq, :, 0])
        return out

    def _make_room(self, layer: int, seq: int) -> None:
        """A free original slot for the step's token: the split follows the length, else the tailor runs."""
        pos = int(self.lengths[seq])
        n = int(self.n_original[layer, seq])
        if n >= self.slots[layer, seq]:
            self._resize(layer, seq, self.rho[layer, seq], pos + 1)
        if n >= self.slots[layer, seq]:
            self._tailor(layer, seq, pos, self._live_originals(layer, seq, n))

    def _attend_one(self, layer: int, seq: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        pos = int(self.lengths[seq])
        n = int(self.n_original[layer, seq])
        K, V, P, S = self._originals[layer][seq]
        K[n], V[n], P[n], S[n] = k, v, pos, 0.0  # committed by end_step (an inactive sequence rewrites it)
        qg = q.view(self.n_kv, self.rep, self.head_dim)
        scaling = self.model.scaling
        scores = (qg @ K[: n + 1].permute(1, 2, 0)) * scaling
        ready = int(self.ready[layer, seq])
        rows = self._rows[layer][seq][self.geo.max_groups - ready:]
        if ready:
            quantized_scores = self.quant_attention.scores(qg.float(), rows, self.geo.layout, scaling)
            scores = torch.cat((scores.float(), quantized_scores), dim=-1)
        weights = scores.float().softmax(dim=-1)
        out = weights[..., : n + 1].to(V.dtype) @ V[: n + 1].permute(1, 0, 2)
        self._observe(S[: n + 1], weights[..., : n + 1])
        if ready:
            quantized = weights[..., n + 1:]
            out = out + self.quant_attention.values(quantized, rows, self.geo.layout).to(out.dtype)
            stats = self._group_fields[layer][seq]["stats"][self.geo.max_groups - ready:]
            self._observe(stats, quantized.unflatten(-1, (ready, GROUP_TOKENS)))
        return out.view(-1, 1, self.head_dim)

    def _attend_batch(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``_attend_one`` for every sequence at once: originals padded to the longest (a shorter sequence's
        padding reads its own last record, masked), quantized rows to the most groups (rows that are not a
        sequence's groups masked, their bytes never used); statistics written back only where a sequence has
        them.  Sizes and indices come from the host's counts: no host sync."""
        dev, b = q.device, q.shape[0]
        n = self.n_original[layer]
        n_dev = to_device(n, dev)
        K, V, P, S = self._batch_originals[layer]
        each = self._batch_index
        K[each, n_dev], V[each, n_dev] = k, v  # committed by end_step (an inactive sequence rewrites it)
        P[each, n_dev] = to_device(self.lengths.astype(np.int32), dev)
        S[each, n_dev] = 0.0
        width = int(n.max()) + 1
        position = torch.arange(width, device=dev)
        upto = torch.minimum(position, n_dev[:, None])  # [B, width]: within each one's records
        live = position <= n_dev[:, None]
        keys, values, stats = K[each[:, None], upto], V[each[:, None], upto], S[each[:, None], upto]
        qg = q.view(b, self.n_kv, self.rep, self.head_dim)
        scaling = self.model.scaling
        scores = ((qg @ keys.permute(0, 2, 3, 1)) * scaling).float().masked_fill(~live[:, None, None], float("-inf"))
        ready = self.ready[layer]
        n_rows = int(ready.max())
        if n_rows:
            rows = self._batch_rows[layer][:, self.geo.max_groups - n_rows:]
            usable = torch.arange(n_rows, device=dev) >= to_device(n_rows - ready, dev)[:, None]  # [B, rows]
            scores = torch.cat((scores, batch_group_scores(qg.float(), rows, self.geo.layout, scaling, usable)), -1)
        weights = scores.softmax(dim=-1)
        out = weights[..., :width].to(values.dtype) @ values.transpose(1, 2)
        self._observe(stats, weights[..., :width].permute(1, 2, 0, 3))
        seqs, records = _flat_index(n + 1)
        at = (to_device(seqs, dev), to_device(records, dev))
        S.index_put_(at, stats[at])
        if n_rows:
            quantized = weights[..., width:]
            out = out + batch_group_values(quantized, rows, self.geo.layout, usable).to(out.dtype)
            group_stats = self.geo.layout.fields(rows)["stats"]  # [B, rows, g, 3]
            observed = group_stats.clone()
            self._observe(observed, quantized.unflatten(-1, (n_rows, GROUP_TOKENS)).permute(1, 2, 0, 3, 4))
            seqs, kept = _flat_index(ready)
            at = (to_device(seqs, dev), to_device(kept + np.repeat(n_rows - ready, ready), dev))
            group_stats.index_put_(at, observed[at])
        return out.view(b, -1, 1, self.head_dim)

    def end_step(self, active: np.ndarray) -> None:
        super().end_step(active)
        self.n_original[:, active] += 1

    def _observe(self, stats: torch.Tensor, weights: torch.Tensor) -> None:
        """Fold one step's weights [H_kv, rep, ...] into stats [..., 3]: a running mean over the first W
        observations, then an exponential one over about the last W."""
        grouped = weights.mean(1)
        x, x2 = grouped.mean(0), (grouped * grouped).mean(0)
        count = stats[..., 0].add_(1)
        rate = count.reciprocal().clamp_(min=1 / self.window)
        stats[..., 1].add_(rate * (x - stats[..., 1]))
        stats[..., 2].add_(rate * (x2 - stats[..., 2]))

    def _score(self, stats: torch.Tensor) -> torch.Tensor:
        """S = mean + gamma * variance (Eq. 9)."""
        mean = stats[..., 1]
        return mean + self.gamma * (stats[..., 2] - mean * mean).clamp(min=0)

    # ---- the tailor ---------------------------------------------------------------------------

    def _tailor(self, layer: int, seq: int, next_pos: int, tokens) -> None:
        """Reassign states: originals outside the window keep the best ``keep_original``; the rest compete with
        the quantized tokens for the quantized capacity; the losers are evicted.  Everything it moves is read
        before anything is written (a new split may reuse an original's bytes for a group)."""
        k, v, pos, stats = tokens
        self.tailors[layer, seq] += 1
        score = self._score(stats)
        window = pos >= next_pos - self.window
        outside = (~window).nonzero()[:, 0]
        ranked = outside[_rank(score[outside], pos[outside])]
        keep_o = int(self.keep_original[layer, seq])
        keep = torch.cat((ranked[:keep_o], window.nonzero()[:, 0])).sort().values
        demote = ranked[keep_o:]

        f = self._group_fields[layer][seq]
        ready = int(self.ready[layer, seq])
        old = slice(self.geo.max_groups - ready, self.geo.max_groups)
        q_pos = f["pos"][old].flatten()
        q_live = (q_pos >= 0).nonzero()[:, 0]
        q_score = self._score(f["stats"][old].reshape(-1, 3)[q_live])
        order = _rank(torch.cat((score[demote], q_score)), torch.cat((pos[demote], q_pos[q_live].long())))
        won = order[: int(self.groups[layer, seq]) * GROUP_TOKENS]
        demoted = demote[won[won < len(demote)]]
        evicted = q_pos.clone()
        evicted[q_live] = -1
        kept_q = q_live[won[won >= len(demote)] - len(demote)]
        evicted[kept_q] = q_pos[kept_q]

        moved = (k[demoted], v[demoted], pos[demoted], stats[demoted])
        originals = (k[keep], v[keep], pos[keep], stats[keep])
        f["pos"][old] = evicted.view(ready, GROUP_TOKENS)
        self._activate_groups(layer, seq)
        self._quantize(layer, seq, moved)
        K, V, P, S = self._originals[layer][seq]
        for dest, src in zip((K, V, P, S), originals):
            dest[: len(keep)] = src
        self.n_original[layer, seq] = len(keep)

    def _quantize(self, layer: int, seq: int, moved) -> None:
        """Write demoted tokens into free groups (by position, GROUP_TOKENS per group); when holes leave too few
        free groups, the emptiest groups are dissolved and their tokens quantized again with the new ones."""
        f, fmt = self._group_fields[layer][seq], self.geo.layout.fmt
        groups = int(self.groups[layer, seq])
        active = torch.arange(self.geo.max_groups - groups, self.geo.max_groups, device=self.arena.device)
        live = (f["pos"][active] >= 0).sum(1)
        free = live == 0
        n_new = len(moved[2])
        if n_new == 0:
            return
        if int(free.sum()) * GROUP_TOKENS < n_new:
            busy = (~free).nonzero()[:, 0]
            busy = busy[torch.argsort(live[busy], stable=True)]
            enough = (int(free.sum()) + torch.arange(1, len(busy) + 1, device=busy.device)) * GROUP_TOKENS \
                >= n_new + live[busy].cumsum(0)
            dissolve = active[busy[: int(enough.nonzero()[0, 0]) + 1]]
            mask = f["pos"][dissolve] >= 0  # [m, g]
            dtype = self.model.dtype
            keys = Quantized(f["k_codes"][dissolve], f["k_scale"][dissolve], f["k_zero"][dissolve], fmt).dequantize(dtype)
            values = Quantized(f["v_codes"][dissolve], f["v_scale"][dissolve], f["v_zero"][dissolve], fmt).dequantize(dtype)
            back = (keys.transpose(1, 2)[mask], values.transpose(1, 2)[mask], f["pos"][dissolve][mask].long(),
                    f["stats"][dissolve][mask])
            moved = tuple(torch.cat((a, b)) for a, b in zip(moved, back))
            f["pos"][dissolve] = -1
            free = (f["pos"][active] < 0).all(1)
        k, v, pos, stats = (t[torch.argsort(moved[2])] for t in moved)
        n_groups = -(-len(pos) // GROUP_TOKENS)
        pad = n_groups * GROUP_TOKENS - len(pos)
        fill = torch.full((pad,), len(pos) - 1, dtype=torch.long, device=pos.device)
        k, v = (torch.cat((t, t[fill])).unflatten(0, (n_groups, GROUP_TOKENS)).transpose(1, 2) for t in (k, v))
        target = active[free.nonzero()[:n_groups, 0]]
        qk, qv = quantize_keys(k, fmt), quantize_values(v, fmt)
        for name, t in (("k_codes", qk.codes), ("k_scale", qk.scale), ("k_zero", qk.zero),
                        ("v_codes", qv.codes), ("v_scale", qv.scale), ("v_zero", qv.zero)):
            f[name][target] = t
        f["pos"][target] = torch.cat((pos, torch.full((pad,), -1, device=pos.device))).view(n_groups, -1).to(torch.int32)
        f["stats"][target] = torch.cat((stats, stats.new_zeros(pad, 3))).view(n_groups, GROUP_TOKENS, 3)

    # ---- inspection (stats and tests) -----------------------------------------------------------

    def token_states(self, layer: int, seq: int) -> tuple[np.ndarray, np.ndarray]:
        """Sorted positions held (original, quantized) by one layer of one sequence."""
        n = int(self.n_original[layer, seq])
        original = self._originals[layer][seq][2][:n]
        quantized = self._group_fields[layer][seq]["pos"][self.geo.max_groups - int(self.ready[layer, seq]):]
        quantized = quantized[quantized >= 0]
        return np.sort(original.cpu().numpy()), np.sort(quantized.cpu().numpy())

    def used_bytes(self, layer: int, seq: int) -> int:
        """Bytes of the arena the split uses: original slots plus quantized groups (never above the arena)."""
        return int(self.slots[layer, seq]) * self.geo.original_bytes + int(self.groups[layer, seq]) * self.geo.layout.record_bytes
