"""Where a prompt's KV comes from: the first source that has it, in order prompt cache -> context store -> compute.

Every source hands the policy the same thing, one layer of K/V at a time through ``store_prompt`` (after the
last prompt queries through ``observe_prompt`` when the policy asks for them), and returns a ``Prefilled``: the
last prompt token's logits, which source served, what it did (``stats``), and the prompt's K/V per layer when
the caller asked to keep it (a server saving a chat turn to the context store).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .forward import prefill
from .kv_policy import KVPolicy
from .model import DecoderModel
from .prompt_cache import PromptKV, PromptKVCache
from .store.errors import ChunkUnavailable
from .ttft.prefill import TTFTOptions, run_prefill

PROMPT_CACHE, CONTEXT_STORE, COMPUTED = "prompt_cache", "context_store", "computed"


@dataclass
class Prefilled:
    logits: torch.Tensor  # [V]: the last prompt token's
    source: str  # PROMPT_CACHE, CONTEXT_STORE or COMPUTED
    stats: dict = field(default_factory=dict)  # the context store's: stored_tokens, ttft_s, the load/compute plan
    kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # per layer, when asked for (``keep_kv``)


class PrefillChain:
    """The sources a batch's prompts are filled from; ``prompt_cache`` and ``context_store`` may be None."""

    def __init__(self, model: DecoderModel, prompt_cache: PromptKVCache | None = None, context_store=None,
                 ttft: TTFTOptions | None = None, emit=None):
        self.model, self.prompt_cache, self.context_store = model, prompt_cache, context_store
        self.ttft = ttft or TTFTOptions()
        self.emit = emit or (lambda kind, **info: None)

    def __call__(self, policy: KVPolicy, seq: int, ids: list[int], keep_kv: bool = False) -> Prefilled:
        return (self._from_prompt_cache(policy, seq, ids, keep_kv) or self._from_context_store(policy, seq, ids, keep_kv)
                or self._computed(policy, seq, ids, keep_kv))

    def _from_prompt_cache(self, policy, seq, ids, keep_kv) -> Prefilled | None:
        """A prompt computed before (the bench's every policy on one prompt): replayed with the queries the policy
        asks for; an entry kept without them is computed again, and replaced."""
        n_queries = policy.prompt_queries
        cached = self.prompt_cache.get(ids) if self.prompt_cache is not None else None
        if cached is None or not cached.has_queries(n_queries):
            return None
        for layer, (k, v) in enumerate(cached.kv):
            if n_queries:
                policy.observe_prompt(layer, seq, cached.queries[layer][:, -n_queries:])
            policy.store_prompt(layer, seq, k, v)
        return Prefilled(cached.logits, PROMPT_CACHE, kv=list(cached.kv) if keep_kv else None)

    def _from_context_store(self, policy, seq, ids, keep_kv) -> Prefilled | None:
        """A stored prefix: each chunk loaded or recomputed, whichever is faster (runtime/ttft), the rest computed.
        A stored context has no queries: the policy gets its KV alone."""
        store = self.context_store
        stored = store.match(ids) if store is not None else None
        if stored is None:
            return None
        result = run_prefill(self.model, ids, store, stored, self.ttft)
        self.emit("prefill_from_store", seq=seq, stored_tokens=stored.n_tokens, method=result.method)
        self._attach_blobs(policy, seq, stored)
        kv = [result.kv.layer(layer) for layer in range(self.model.dims.n_layers)]
        for layer, (k, v) in enumerate(kv):
            policy.store_prompt(layer, seq, k, v)
        return Prefilled(result.logits, CONTEXT_STORE, result.stats, kv if keep_kv else None)

    def _attach_blobs(self, policy: KVPolicy, seq: int, stored) -> None:
        """A local store's blobs, up to the first chunk damaged or dropped meanwhile, offered to the policy to read
        in place (a disk policy with the store's record layout; the policy writes the rest)."""
        store = self.context_store
        if store.root is None or not policy.reads_in_place(store.layout):
            return
        G = store.layout.group_tokens
        blobs = []
        for ref in stored.chunks:
            try:
                blobs.append((store.backend.blob_path(ref.hash), ref.n_tokens // G, store.record_sums(ref)))
            except ChunkUnavailable:
                break
        policy.attach_prefix(seq, store.layout, blobs)

    def _computed(self, policy, seq, ids, keep_kv) -> Prefilled:
        """The prompt through the model; kept in the prompt cache (with the queries the policy asked for)."""
        n_queries = policy.prompt_queries
        keep = keep_kv or self.prompt_cache is not None
        kept, queries = [], []

        def on_kv(layer, k, v):
            policy.store_prompt(layer, seq, k, v)
            if keep:
                kept.append((k, v))

        def on_queries(layer, q):
            policy.observe_prompt(layer, seq, q[:, -n_queries:])
            if self.prompt_cache is not None:
                queries.append(q[:, -n_queries:].clone())

        logits = prefill(self.model, ids, on_kv, on_queries if n_queries else None)
        if self.prompt_cache is not None:
            self.prompt_cache.put(ids, PromptKV(kept, logits, queries or None))
        return Prefilled(logits, COMPUTED, kv=kept if keep_kv else None)
