"""The engine: load a checkpoint, build the KV policy, prefill, and run the decode loop.

The whole offloading policy is visible in ``_make_policy``; a batch's prefill and decode steps go through
``RunningBatch`` (runtime/batching.py: timings, step events), which ``_run_batch`` drives to the end and a
server keeps open (``open_batch``: sequences join and leave between steps).
"""
from __future__ import annotations

import contextlib
import json
import logging
import operator
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from .adapter import LowRankAdapter
from .checkpoints import load_tokenizer, resolve_checkpoint
from .arkv import ArkvGeometry, ArkvKV
from .batching import RunningBatch
from .cluster import CoactivationLayout
from .config import IN_MEMORY_POLICIES, ConfigError, RuntimeConfig
from .disk_store import CorruptRecord, DiskKVStore, RecordLayout, check_offload_path, kv_path_list
from .events import EventBus, JsonLinesLog
from .forward import prefill
from .hillinfer import HierarchicalSelector
from .kv_policy import InMemoryKV, KVPolicy
from .memory import MemoryPlan, plan_memory
from .model import DecoderModel, ModelDims, load_model, read_model_config
from .offload import OffloadedKV
from .prompt_cache import PromptKV, PromptKVCache
from .reader import KVReader, open_reader
from .sampling import Sampler, SamplingParams
from .scoring import InStorageScorer, NumpyScorer
from .selector import KEYS_PER_RANK, AllGroupsSelector, LowRankSelector, RandomSelector
from .slots import PreloadSlots, SlotTable
from .solutions import SolutionTable, load_deployed
from .store.errors import ChunkUnavailable
from .ttft.compute import PrefixKV
from .ttft.prefill import TTFTOptions, run_prefill

log = logging.getLogger(__name__)



@dataclass
class GenerationResult:
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" (a stop token), "length" (max_new_tokens or max_context)
    stats: dict = field(default_factory=dict)
    logits: torch.Tensor | None = None  # [generated, vocab] float32, with output_logits=True


class Engine:
    def __init__(
        self,
        model: DecoderModel,
        config: RuntimeConfig,
        policy: str = "kvswap",
        kv_offload_path: str | Path | list | None = None,
        tokenizer=None,
        adapter: LowRankAdapter | None = None,
        solutions: SolutionTable | None = None,
        scorer: InStorageScorer | None = None,
        reader: KVReader | None = None,
    ):
        """``kv_offload_path``: the KV disk's folder, or a list of folders on several devices (records spread
        over them, read through one queue each).  ``reader``: a KV reader to use (and close) instead of opening
        ``config.reader_backend`` (e.g. an emulated multi-device reader, runtime.reader.open_reader)."""
        self.model = model
        self.tokenizer = tokenizer
        self.policy = policy
        self.config = config.for_policy(policy)
        self.kv_paths = [Path(p) for p in kv_path_list(kv_offload_path)]
        self.kv_offload_path = self.kv_paths[0] if self.kv_paths else None
        self.adapter = adapter
        self.solutions = solutions
        self.scorer = scorer  # hillinfer's in-storage scorer (a platform's backend); the numpy reference if None
        self.prompt_cache: PromptKVCache | None = None  # set to share prompt KV across engines on this model
        self.prompt_sink = None  # prompt_sink(ids, [(k, v)] per layer) after each prefill: a server saves turns with it
        self.context_store = None  # a runtime.store.ContextStore (open_context_store): stored prefixes skip compute
        self.ttft = TTFTOptions(compute_costs=_ttft_costs(self.config.ttft_costs_path))  # prefill with a stored prefix
        self.prefill_stats: list[dict] = []  # per prompt of the last batch: how its prefill went
        self._adapters: dict[str, LowRankAdapter] = {}
        self.events = EventBus()
        if os.environ.get("EDGEKV_EVENTS_FILE"):  # set by `edgekv energy` for the process it measures
            self.events.subscribe(JsonLinesLog(os.environ["EDGEKV_EVENTS_FILE"]))
        self._warned_adapter = False
        self.rank, self.memory_plan = _preflight(policy, self.config, model.dims, model.dtype, adapter, kv_offload_path)
        self.reader: KVReader | None = reader
        if policy not in IN_MEMORY_POLICIES and reader is None:
            self.reader = open_reader(self.config.reader_backend, self.config.io_queue_depth, n_paths=len(self.kv_paths))
        if policy not in IN_MEMORY_POLICIES and self.config.verify_fraction < 1:
            log.warning("verify_fraction=%g: %s", self.config.verify_fraction,
                        "KV records read are not checked against their checksums" if self.config.verify_fraction == 0
                        else f"a damaged KV record is caught with probability {self.config.verify_fraction:g} per read")

    @classmethod
    def from_pretrained(
        cls,
        model: str | Path,
        kv_offload_path: str | Path | list | None = None,
        config: RuntimeConfig | dict | str | Path | None = None,
        policy: str = "kvswap",
        device: str | torch.device | None = None,
        dtype: torch.dtype | None = None,
        scorer: InStorageScorer | None = None,
    ) -> "Engine":
        """Everything that can be refused is checked before the weights are loaded.

        ``model``: a Hugging Face folder, a ``.gguf`` file (or a folder holding one), or a name
        (``fixture``, ``smollm2``), resolved by ``edgekv.runtime.checkpoints``.
        ``config`` may be a deployed config (with ``solutions``): each batch then runs with the
        solution for its (batch size, context), each checked here against its memory budget.
        """
        cfg, solutions = load_deployed(config)
        model_dir = resolve_checkpoint(model)
        hf_cfg = read_model_config(model_dir)
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        dtype = dtype or _default_dtype(device)
        dims = ModelDims.from_config(hf_cfg)
        adapter = _load_adapter(cfg, policy)
        _ttft_costs(cfg.ttft_costs_path)  # a bad cost model file is named before the weights load
        _preflight(policy, cfg.for_policy(policy), dims, dtype, adapter, kv_offload_path)
        for _, _, sol in solutions or []:
            _preflight(policy, sol.for_policy(policy), dims, dtype, _load_adapter(sol, policy), kv_offload_path)
        max_context = max([cfg.max_context] + [s.max_context for _, _, s in solutions or []])
        decoder = load_model(model_dir, device, dtype, max_context)
        return cls(decoder, cfg, policy, kv_offload_path, load_tokenizer(model_dir), adapter, solutions, scorer)

    # ---- the context store ----------------------------------------------------------------------

    def open_context_store(self, location: str | Path, chunk_tokens: int = 512, max_bytes: int | None = None):
        """Attach a context store (a local folder, or an http(s):// URL of a published one, read-only).

        Prompts then reuse their longest stored prefix; ``save_context`` adds contexts to it.
        """
        from .store import ContextStore, model_fingerprint

        dims = self.model.dims
        found = ContextStore.geometry_at(location) or {}  # an existing store keeps its geometry
        G = found.get("group_tokens", self.config.G)
        layout = RecordLayout(G, dims.n_kv_heads, dims.head_dim, self.model.dtype,
                              found.get("align_bytes", self.config.io_align_bytes))
        self.context_store = ContextStore.open(location, model_fingerprint(self.model), layout, dims.n_layers,
                                               chunk_tokens=found.get("chunk_tokens", chunk_tokens), max_bytes=max_bytes)
        return self.context_store

    @torch.inference_mode()
    def save_context(self, context, name: str | None = None):
        """Compute a context's KV once (text, token ids, or chat messages) and keep it in the store; returns what is stored.

        A prompt that starts with it later loads or recomputes each chunk, whichever is faster (``ttft``).
        """
        if self.context_store is None:
            raise ValueError("no context store: call open_context_store(folder) first (CLI: --kv-path)")
        ids = self._tokenize([context])[0]
        kv = PrefixKV(self.model, len(ids))
        prefill(self.model, ids, kv.put_prompt)
        return self.context_store.put(ids, [kv.layer(layer) for layer in range(self.model.dims.n_layers)], name=name)

    def context_ids(self, name: str) -> list[int]:
        if self.context_store is None:
            raise ValueError(f"context {name!r} asked for but no context store is open: pass the --kv-path it was saved to")
        return self.context_store.context_ids(name)

    # ---- generation -------------------------------------------------------------------------

    def generate(
        self,
        prompts,
        max_new_tokens: int = 256,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        stop_token_ids: list[int] | None = None,
        output_logits: bool = False,
        teacher_forcing: list[list[int]] | None = None,
        chat: bool = False,
        context: str | None = None,
    ) -> list[GenerationResult]:
        """One result per prompt (strings, token-id lists, or chat messages), in order; batches of at most max_batch.

        A prompt given as messages (a list of {"role", "content"} dicts) goes through the
        checkpoint's chat template, as does every string prompt with ``chat=True``.

        stop_token_ids None means the checkpoint's eos ids; output_logits keeps each step's logits.
        teacher_forcing: per prompt, tokens fed as the decode inputs instead of the sampled ones
        (so every continuation token goes through the decode path and its KV policy); token_ids
        then holds the model's choice after the prompt and after each forced token.
        context: the name of a stored context, put before every prompt (its KV comes from the store).
        """
        if context is not None:
            head = self.context_ids(context)
            prompts = [head + _own_ids(p, lambda q: self._tokenize([q], chat)[0]) for p in prompts]
        token_prompts = self._tokenize(prompts, chat)
        forced = teacher_forcing or [None] * len(token_prompts)
        if len(forced) != len(token_prompts):
            raise ValueError(f"teacher_forcing has {len(forced)} entries for {len(token_prompts)} prompts")
        for i, (p, f) in enumerate(zip(token_prompts, forced)):
            if f is not None and len(p) + len(f) >= self.config.max_context:
                raise ValueError(f"prompt {i} plus its {len(f)} forced tokens exceed max_context {self.config.max_context}")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        params = SamplingParams(temperature, top_k, top_p, seed)
        stops = set(self.default_stops() if stop_token_ids is None else stop_token_ids)
        sampler = Sampler(params, self.model.device)
        results = []
        step = self.config.max_batch
        for start in range(0, len(token_prompts), step):
            chunk = slice(start, start + step)
            results += self._run_checked(token_prompts[chunk], forced[chunk], max_new_tokens, sampler, stops, output_logits)
        return results

    def _run_checked(self, prompts, forced, max_new_tokens: int, sampler: Sampler, stops: set[int], output_logits: bool):
        """``_run_batch``; a KV record that failed its checksum sends the batch through once more from its tokens (a
        stored chunk it came from is dropped first), with the sampler where it was: the same tokens as an
        undamaged run.  Damage in the fresh files too surfaces as the CorruptRecord naming them."""
        state = sampler.state()
        try:
            return self._run_batch(prompts, forced, max_new_tokens, sampler, stops, output_logits)
        except CorruptRecord as exc:
            if exc.blob is not None and self.context_store is not None:
                self.context_store.forget_chunk(exc.blob)
            log.warning("%s", exc)
            self.events.emit("kv_corrupt", path=exc.path, record=exc.record, layer=exc.layer, group=exc.group)
        sampler.restore(state)
        return self._run_batch(prompts, forced, max_new_tokens, sampler, stops, output_logits)

    def tokenize(self, prompt, chat: bool = False) -> list[int]:
        """One prompt (text, token ids or chat messages) as checked token ids: in the vocabulary, shorter than
        max_context; a ValueError names what is wrong."""
        return self._tokenize([prompt], chat)[0]

    def _tokenize(self, prompts, chat: bool = False) -> list[list[int]]:
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, (list, tuple)):
            raise ValueError("prompts must be a list of strings or of token-id lists")
        if not prompts:
            raise ValueError("prompts is empty: pass at least one prompt")
        vocab, out = self.model.dims.vocab, []

        def token_id(i: int, j: int, t) -> int:
            """Whole numbers only: int() would truncate 1.5, parse "7" and take True as 1."""
            with contextlib.suppress(TypeError):
                if not isinstance(t, bool):
                    return operator.index(t)
            raise ValueError(f"prompt {i} token {j} is {t!r:.40} ({type(t).__name__}); token ids are whole numbers "
                             f"in [0, {vocab})")

        for i, p in enumerate(prompts):
            if isinstance(p, str) and chat:
                p = [{"role": "user", "content": p}]
            if _is_messages(p):
                lacking = next((j for j, m in enumerate(p) if not {"role", "content"} <= set(m)), None)
                if lacking is not None:
                    raise ValueError(f"prompt {i} message {lacking} is {p[lacking]!r}; a chat message is "
                                     "{'role': 'user', 'content': TEXT}")
                p = self._apply_chat_template(i, p)
            elif isinstance(p, str):
                if self.tokenizer is None:
                    raise ValueError(f"prompt {i} is a string but {self.model.hf.name_or_path} has no tokenizer; pass token ids")
                p = self.tokenizer(p)["input_ids"]
            elif isinstance(p, (bytes, bytearray, dict)) or not hasattr(p, "__iter__"):
                # bytes would iterate as their byte values: token ids nobody meant
                raise ValueError(f"prompt {i} is {type(p).__name__} {p!r:.40}; pass text (str), a list of token ids "
                                 "or chat messages")
            ids = [token_id(i, j, t) for j, t in enumerate(p)]
            if not ids:
                raise ValueError(f"prompt {i} is empty: pass at least one token (or non-empty text)")
            bad = next((j for j, t in enumerate(ids) if not 0 <= t < vocab), None)
            if bad is not None:
                raise ValueError(f"prompt {i} token {bad} is {ids[bad]}, outside the vocabulary [0, {vocab}) of "
                                 f"{self.model.hf.name_or_path}; use token ids of this model's tokenizer")
            if len(ids) >= self.config.max_context:
                raise ValueError(
                    f"prompt {i} has {len(ids)} tokens but max_context is {self.config.max_context} "
                    "(room is needed for generated tokens); raise max_context or shorten the prompt"
                )
            out.append(ids)
        return out

    def _apply_chat_template(self, i: int, messages: list[dict]) -> list[int]:
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(f"prompt {i} is a chat but {self.model.hf.name_or_path} has no chat template; "
                             "pass plain text (drop --chat / chat=True)")
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
        return list(ids["input_ids"])

    def default_stops(self) -> list[int]:
        """The checkpoint's end-of-sequence ids (generation_config), where a generation stops by default."""
        eos = getattr(self.model.hf.generation_config, "eos_token_id", None)
        if eos is None:
            return []
        return list(eos) if isinstance(eos, (list, tuple)) else [eos]

    def open_batch(self, rows: int, context: int) -> RunningBatch:
        """A decode batch of ``rows`` sequences that join and leave between steps (a server's continuous batching),
        run with the solution for (rows, context): every sequence it takes needs at most ``context`` tokens."""
        if not 1 <= rows <= self.config.max_batch:
            raise ValueError(f"a batch of {rows} rows: the config allows 1 to max_batch={self.config.max_batch}")
        return RunningBatch(self, rows, self.batch_config(rows, context))

    @torch.inference_mode()
    def _run_batch(self, prompts, forced, max_new_tokens: int, sampler: Sampler, stops: set[int], output_logits: bool):
        batch = len(prompts)
        needed = max(len(p) + (len(f) + 1 if f is not None else max_new_tokens) for p, f in zip(prompts, forced))
        self.prefill_stats = []
        with RunningBatch(self, batch, self.batch_config(batch, needed)) as run:
            cfg = run.cfg
            owners = _prefix_owners(prompts, cfg.G) if cfg.share_prefix else [None] * batch
            logits = torch.stack([run.join(seq, ids, owners[seq]) for seq, ids in enumerate(prompts)])
            run.end_prefill()

            chosen = sampler(logits)
            generated = [[int(t)] for t in chosen]
            tokens = _next_inputs(chosen, generated, forced)
            kept = [[row] for row in logits] if output_logits else None
            limit = [len(f) + 1 if f is not None else min(max_new_tokens, cfg.max_context - len(p))
                     for p, f in zip(prompts, forced)]
            stops_of = [stops if f is None else set() for f in forced]
            done = np.array([g[0] in st or lim <= 1 for g, st, lim in zip(generated, stops_of, limit)])
            decode_s = np.zeros(batch)
            start = time.perf_counter()
            while not done.all():
                active = ~done
                logits = run.step(tokens, active)
                chosen = sampler(logits)
                for seq in np.flatnonzero(active):
                    generated[seq].append(int(chosen[seq]))
                    if kept is not None:
                        kept[seq].append(logits[seq])
                    if generated[seq][-1] in stops_of[seq] or len(generated[seq]) >= limit[seq]:
                        done[seq] = True
                        decode_s[seq] = time.perf_counter() - start
                tokens = _next_inputs(chosen, generated, forced)
            results = [run.result(seq, generated[seq], stops, decode_s[seq]) for seq in range(batch)]
            for seq, result in enumerate(results if kept is not None else []):
                result.logits = torch.stack(kept[seq]).cpu()
        return results

    def _prefill(self, policy: KVPolicy, seq: int, ids: list[int]) -> torch.Tensor:
        """Compute the prompt's KV into the policy, or replay it from ``prompt_cache`` when set and filled (with the
        queries the policy asks for: an entry kept without them is computed again, and replaced).  A stored
        context has no queries: the policy gets its KV alone."""
        n_queries = policy.prompt_queries
        cached = self.prompt_cache.get(ids) if self.prompt_cache is not None else None
        if cached is not None and cached.has_queries(n_queries):
            for layer, (k, v) in enumerate(cached.kv):
                if n_queries:
                    policy.observe_prompt(layer, seq, cached.queries[layer][:, -n_queries:])
                policy.store_prompt(layer, seq, k, v)
            return cached.logits
        stored = self.context_store.match(ids) if self.context_store is not None else None
        if stored is not None:
            result = run_prefill(self.model, ids, self.context_store, stored, self.ttft)
            self.prefill_stats.append(result.stats)
            self.events.emit("prefill_from_store", seq=seq, stored_tokens=stored.n_tokens, method=result.method)
            self._attach_stored(policy, seq, stored)
            for layer in range(self.model.dims.n_layers):
                policy.store_prompt(layer, seq, *result.kv.layer(layer))
            if self.prompt_sink is not None:
                self.prompt_sink(ids, [result.kv.layer(layer) for layer in range(self.model.dims.n_layers)])
            return result.logits
        kept, queries = [], []

        def keep(layer, k, v):
            policy.store_prompt(layer, seq, k, v)
            if self.prompt_cache is not None or self.prompt_sink is not None:
                kept.append((k, v))

        def observe(layer, q):
            policy.observe_prompt(layer, seq, q[:, -n_queries:])
            if self.prompt_cache is not None:
                queries.append(q[:, -n_queries:].clone())

        logits = prefill(self.model, ids, keep, observe if n_queries else None)
        if self.prompt_cache is not None:
            self.prompt_cache.put(ids, PromptKV(kept, logits, queries or None))
        if self.prompt_sink is not None:
            self.prompt_sink(ids, kept)
        return logits

    def _attach_stored(self, policy: KVPolicy, seq: int, stored) -> None:
        """A disk policy with the store's record layout reads the stored prefix from the store's blobs in place
        (its own files get only the rest); a remote store or another layout (quantized records: the store keeps
        model precision) is copied like any prompt."""
        store = self.context_store
        disk = getattr(policy, "store", None)
        if not isinstance(policy, OffloadedKV) or store.root is None or disk.layout != store.layout:
            return
        G = store.layout.group_tokens
        blobs = []
        for ref in stored.chunks:  # up to the first chunk damaged or dropped meanwhile: the policy writes the rest
            try:
                blobs.append((store.backend.blob_path(ref.hash), ref.n_tokens // G, store.record_sums(ref)))
            except ChunkUnavailable:
                break
        try:
            disk.attach_prefix(seq, blobs)
        except FileNotFoundError:  # a blob removed after its trailer was read (damage found by another reader)
            pass

    def _decode_step(self, policy: KVPolicy, tokens: torch.Tensor, active: np.ndarray) -> torch.Tensor:
        """One token for every sequence: layer i+1's KV is fetched while layer i computes."""
        model = self.model
        x = model.embed(tokens[:, None].to(model.device))
        cos, sin = model.rope(torch.from_numpy(policy.lengths).to(model.device)[:, None])
        policy.prefetch(0, x, cos, sin, active)
        for layer in range(model.dims.n_layers):
            if layer + 1 < model.dims.n_layers:
                policy.prefetch(layer + 1, x, cos, sin, active)
            q, k, v = model.qkv(layer, x, cos, sin)
            x = model.finish_layer(layer, x, policy.attend(layer, q, k, v))
        return model.logits(x[:, 0])

    def _result(self, policy, cfg, seq, prompt, generated, stops, prefill_s, decode_s) -> GenerationResult:
        hits, lookups = policy.reuse_counts()
        decode_tokens = len(generated) - 1
        finish = "stop" if generated[-1] in stops else "length"
        stats = {
            "policy": self.policy,
            "prompt_tokens": len(prompt),
            "generated_tokens": len(generated),
            "prefill_s": prefill_s,
            "decode_s": float(decode_s),
            "decode_tok_s": decode_tokens / decode_s if decode_s > 0 else 0.0,
            "kv_bytes_read": int(policy.bytes_read[seq]),
            "reuse_rate": float(hits[seq] / lookups[seq]) if lookups[seq] else 0.0,
            "reuse_hits": int(hits[seq]),
            "reuse_lookups": int(lookups[seq]),
            "io_stall_s": policy.io_stall_s,
            "io_read_s": policy.io_read_s,
            "select_s": policy.select_s,
            "io_stall_share": policy.io_stall_s / decode_s if decode_s > 0 else 0.0,
            "kv_resident_bytes": policy.resident_bytes,
            "batch_size": policy.batch,
            "reader": self.reader.name if self.reader else None,
            "o_direct": getattr(getattr(policy, "store", None), "o_direct", None),
            **_store_stats(getattr(policy, "store", None)),
            "scorer_fallback": getattr(getattr(policy, "selector", None), "fallback", None),  # hillinfer on the CPU: why
            "config": {k: getattr(cfg, k) for k in ("G", "M", "C", "sigma", "reuse", "rolling_buffer", "max_context",
                                                    "kv_record_dtype")}
            | {"rank": self._rank(cfg)},
        }
        text = self.tokenizer.decode(generated, skip_special_tokens=True) if self.tokenizer else ""
        return GenerationResult(generated, text, finish, stats)

    # ---- the offloading policy, in one place ------------------------------------------------

    def batch_config(self, batch: int, context: int) -> RuntimeConfig:
        """The solution for this (batch, context) when the config has solutions, else the config."""
        if self.solutions is None:
            return self.config
        return self.solutions.pick(batch, context).for_policy(self.policy)

    def _adapter_for(self, cfg: RuntimeConfig) -> LowRankAdapter | None:
        if cfg.adapter_path and self.policy in ("kvswap", "token"):
            if cfg.adapter_path not in self._adapters:
                self._adapters[cfg.adapter_path] = LowRankAdapter.load(cfg.adapter_path)
            return self._adapters[cfg.adapter_path]
        if self.adapter is not None and self.adapter.rank == LowRankAdapter.rank_for(
                self.model.dims.n_kv_heads, self.model.dims.head_dim, cfg.sigma or self.adapter.sigma):
            return self.adapter
        return None

    def _rank(self, cfg: RuntimeConfig) -> int:
        adapter = self._adapter_for(cfg)
        return adapter.rank if adapter else LowRankAdapter.rank_for(self.model.dims.n_kv_heads, self.model.dims.head_dim, cfg.sigma)

    def _make_policy(self, batch: int, cfg: RuntimeConfig) -> KVPolicy:
        model, dims = self.model, self.model.dims
        if self.policy == "full":
            return InMemoryKV(model, batch, cfg.max_context)
        if self.policy == "arkv":  # a budget holding the whole cache: nothing to tailor, exactly `full`
            fits = ArkvGeometry(cfg, dims, torch.empty(0, dtype=model.dtype).element_size()).fits_all
            return InMemoryKV(model, batch, cfg.max_context) if fits else ArkvKV(model, batch, cfg)
        layout = _record_layout(cfg, dims, model.dtype)
        max_groups = -(-cfg.max_context // cfg.G)
        store = DiskKVStore(self.kv_paths, dims.n_layers, layout, self.reader, max_groups, cfg.max_request_bytes,
                            cfg.verify_fraction)
        if self.policy == "flexgen":
            selector = AllGroupsSelector(cfg.M, model.device)
        elif self.policy == "hillinfer":
            selector = HierarchicalSelector(
                self.scorer or NumpyScorer(), store.dir, dims.n_layers, batch, cfg.max_context, dims.n_kv_heads,
                dims.head_dim, cfg.importance_rate, cfg.beta, model.scaling, cfg.score_block_tokens,
            )
        elif cfg.selector == "random":
            selector = RandomSelector(cfg.picked_groups)
        else:
            adapter, rank = self._adapter_for(cfg), self._rank(cfg)
            if adapter is None and not self._warned_adapter:
                log.warning(
                    "no adapter file: fitting the low-rank K adapter (rank %d) on this batch's prompt keys, kept once a "
                    "batch gives %d keys per layer; build a calibrated one with edgekv.install for better predictions",
                    rank, KEYS_PER_RANK * rank,
                )
                self._warned_adapter = True
            selector = LowRankSelector(
                adapter, rank, dims.n_kv_heads, dims.head_dim, dims.n_layers, batch,
                cfg.max_context, cfg.G, cfg.picked_groups, cfg.klr_dtype, model.device,
                score_reduce=cfg.score_reduce, scaling=model.scaling,
            )
        slots = SlotTable(dims.n_layers, batch, cfg.C, max_groups, cfg.replacement) if cfg.reuse \
            else PreloadSlots(batch, cfg.picked_groups)
        return OffloadedKV(
            model, batch, cfg.max_context, store, selector, slots, cfg.picked_groups,
            rolling_buffer=cfg.rolling_buffer, sink_groups=cfg.sink_groups, window_groups=cfg.window_groups,
            oracle=cfg.selector == "oracle", predict=self.policy != "flexgen",
            on_select=lambda layer, groups, valid: self.events.emit("groups_selected", layer=layer, groups=groups, valid=valid),
            placer=CoactivationLayout(cfg.cluster_queries, cfg.cluster_radius, cfg.replica_share, model.scaling,
                                      layout.stride_bytes) if cfg.clustering and self.policy in ("kvswap", "token") else None,
            recluster_steps=cfg.recluster_steps, read_deadline_s=cfg.read_deadline_s,
        )

    def _keep_fitted_adapter(self, policy: KVPolicy, cfg: RuntimeConfig) -> None:
        """A projection fitted on a batch's prompts is kept for later batches of the same rank when it saw
        enough keys (KEYS_PER_RANK x rank per layer); a coarser one serves this batch only, and says so."""
        if self._adapter_for(cfg) is not None or not isinstance(policy, OffloadedKV) \
                or not isinstance(policy.selector, LowRankSelector):
            return
        fitted, n_keys = policy.selector.fitted_adapter()
        if fitted is None:
            return
        if n_keys >= KEYS_PER_RANK * fitted.rank:
            self.adapter = fitted
            return
        log.warning("the low-rank K adapter (rank %d) of this batch was fitted on %d keys per layer, fewer than the %d "
                    "a stable fit needs: predictions are coarse, and the next batch fits its own; pass an adapter file "
                    "from the install step to avoid this", fitted.rank, n_keys, KEYS_PER_RANK * fitted.rank)

    def close(self) -> None:
        if self.reader is not None:
            self.reader.close()
            self.reader = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _store_stats(store) -> dict:
    """The batch's read requests over its KV paths (every sequence's together: one step's reads are one batch)."""
    if store is None:
        return {"n_paths": 0, "kv_read_requests": 0, "kv_records_read": 0, "kv_records_by_path": [],
                "kv_records_verified": 0, "kv_records_reread": 0}
    return {"n_paths": store.n_paths, "kv_read_requests": store.requests, "kv_records_read": store.records_read,
            "kv_records_by_path": store.records_by_path.tolist(), "kv_records_verified": store.records_verified,
            "kv_records_reread": store.records_reread}


def _prefix_owners(prompts: list[list[int]], group_tokens: int) -> list[tuple[int, int] | None]:
    """Per prompt, (owner, whole groups) of the earlier prompt it shares the most leading groups with (a batch
    of questions over one document), or None; owners lend only their own groups, so no chain forms."""
    owners: list[tuple[int, int] | None] = []
    for ids in prompts:
        best = None
        for a, other in enumerate(prompts[: len(owners)]):
            if owners[a] is not None:
                continue
            n = min(len(ids), len(other))
            same = np.flatnonzero(np.asarray(ids[:n]) != np.asarray(other[:n]))
            groups = (int(same[0]) if len(same) else n) // group_tokens
            if groups >= 1 and (best is None or groups > best[1]):
                best = (a, groups)
        owners.append(best)
    return owners


def _next_inputs(chosen: torch.Tensor, generated: list[list[int]], forced) -> torch.Tensor:
    """The next decode inputs: the chosen tokens, or the next forced token where teacher forcing applies."""
    inputs = chosen.clone()
    for seq, f in enumerate(forced):
        if f is not None and len(generated[seq]) <= len(f):
            inputs[seq] = f[len(generated[seq]) - 1]
    return inputs


def _own_ids(prompt, tokenize) -> list[int]:
    """A prompt's tokens after a stored context: none for an empty prompt (the context alone), ids as given."""
    if not prompt:
        return []
    if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
        return list(prompt)
    return tokenize(prompt)


def _is_messages(prompt) -> bool:
    return isinstance(prompt, (list, tuple)) and bool(prompt) and all(isinstance(m, dict) for m in prompt)


def _load_adapter(cfg: RuntimeConfig, policy: str) -> LowRankAdapter | None:
    return LowRankAdapter.load(cfg.adapter_path) if cfg.adapter_path and policy in ("kvswap", "token") else None


def _preflight(policy, cfg: RuntimeConfig, dims: ModelDims, dtype, adapter, kv_offload_path) -> tuple[int, MemoryPlan]:
    """Refuse what cannot run (adapter mismatch, over budget, bad offload path); returns (rank, plan)."""
    if adapter is not None:
        adapter.check(dims.n_layers, dims.n_kv_heads, dims.head_dim)
        if cfg.sigma is not None and abs(adapter.sigma - cfg.sigma) > 0.5:
            raise ConfigError(
                f"config 'sigma' is {cfg.sigma:g} but the adapter file {cfg.adapter_path} has sigma {adapter.sigma:g}; "
                "drop 'sigma' or point 'adapter_path' at a matching adapter"
            )
    rank = adapter.rank if adapter else LowRankAdapter.rank_for(dims.n_kv_heads, dims.head_dim, cfg.sigma)
    plan = _plan(policy, cfg, dims, dtype, rank)
    plan.check(cfg.max_kv_mem_mib, policy)
    if policy not in IN_MEMORY_POLICIES:
        for path in kv_path_list(kv_offload_path) or [None]:
            check_offload_path(path)
    return rank, plan


def _plan(policy: str, cfg: RuntimeConfig, dims: ModelDims, dtype: torch.dtype, rank: int) -> MemoryPlan:
    itemsize = torch.empty(0, dtype=dtype).element_size()
    return plan_memory(policy, cfg, dims, itemsize, rank, _record_layout(cfg, dims, dtype).stride_bytes)


def _record_layout(cfg: RuntimeConfig, dims: ModelDims, dtype: torch.dtype) -> RecordLayout:
    """The disk policies' records in ``kv_record_dtype``; a format this model cannot take is named as the config field."""
    layout = RecordLayout(cfg.G, dims.n_kv_heads, dims.head_dim, dtype, cfg.io_align_bytes, cfg.kv_record_dtype)
    try:
        layout.codec  # built now: a format the model cannot take fails before the weights load
    except ValueError as exc:
        raise ConfigError(f"config field 'kv_record_dtype' {cfg.kv_record_dtype!r}: {exc}; pick another format") from exc
    return layout


def _ttft_costs(path: str | None):
    """The chunk compute predictor the install step fit (``ttft_costs_path``); None: calibrated on first use."""
    if path is None:
        return None
    from .ttft.costs import cost_model_from_json

    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"config 'ttft_costs_path' {path}: cannot read the cost model ({exc}); "
                          "run the deploy step again or drop the field") from exc
    return cost_model_from_json(data.get("predictor", data))


def _default_dtype(device: torch.device) -> torch.dtype:
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32

