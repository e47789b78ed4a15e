"""The engine: load a checkpoint, tokenize, generate, and open decode batches.

A batch (``RunningBatch``, runtime/batching.py) owns the step pipeline: it builds the policy from the registry
(runtime/policies/), fills prompts through the prefill chain (prompt cache -> context store -> compute) and
runs the decode steps; ``generate`` drives one to the end, a server keeps one open (``open_batch``: sequences
join and leave between steps).
"""
from __future__ import annotations

import contextlib
import json
import logging
import operator
import os
import time
import warnings
from pathlib import Path

import numpy as np
import torch

from .adapter import AdapterSet, LowRankAdapter, build_adapter
from .batching import GenerationResult, RunningBatch
from .checkpoints import load_tokenizer, resolve_checkpoint
from .config import ConfigError, RuntimeConfig, read_config_file
from .devices import resolve_device, resolve_dtype
from .disk_store import CorruptRecord, RecordLayout, check_kv_path, kv_path_list
from .errors import unencodable
from .events import EventBus, JsonLinesLog
from .forward import prefill
from .kernels import resolve_backend
from .memory import MemoryPlan, plan_memory
from .model import DecoderModel, ModelDims, load_model, read_model_config
from .policies import PolicyEnv, get as get_policy
from .policies.disk import record_layout as _record_layout
from .prefill_chain import CONTEXT_STORE
from .prompt_cache import PromptKVCache
from .reader import KVReader, open_reader
from .sampling import Sampler, SamplingParams
from .scoring import InStorageScorer
from .solutions import SolutionTable, deployed_compute, load_deployed
from .synth import synthetic_dtype
from .ttft.compute import PrefixKV
from .ttft.prefill import TTFTOptions
from .weights import check_weight_format, resolve_weights

__all__ = ["Engine", "GenerationResult"]

log = logging.getLogger(__name__)


class Engine:
    def __init__(
        self,
        model: DecoderModel,
        config: RuntimeConfig,
        policy: str = "kvswap",
        kv_path: str | Path | list | None = None,
        tokenizer=None,
        adapter: LowRankAdapter | None = None,
        solutions: SolutionTable | None = None,
        scorer: InStorageScorer | None = None,
        reader: KVReader | None = None,
        backend: str | None = None,
        *,
        kv_offload_path: str | Path | list | None = None,
    ):
        """``policy``: the policy's name (``policy_name``; a batch holds the policy built from it).  ``kv_path``:
        the KV disk's folder, or a list of folders on several devices (records spread over them, read through one
        queue each); ``kv_offload_path`` is its old name, still read with a DeprecationWarning.  ``reader``: a KV
        reader to use (and close) instead of opening ``config.io.reader_backend`` (e.g. an emulated multi-device
        reader, runtime.reader.open_reader).
        ``backend``: what the policies' kernels run on (runtime/kernels.py BACKENDS; None: the device's own, "torch":
        the reference)."""
        self.model = model
        self.backend = resolve_backend(model.device, backend)
        self.tokenizer = tokenizer
        kv_path = _renamed_kv_path(kv_path, kv_offload_path)
        self.policy_name = policy
        self.spec = get_policy(policy)  # the registered policy (runtime/policies/): traits, memory, how it is built
        self.config = self.spec.effective_config(config)
        self.kv_paths = [Path(p) for p in kv_path_list(kv_path)]
        self.kv_path = self.kv_paths[0] if self.kv_paths else None  # the first: the context store's disk
        self.adapters = AdapterSet(model.dims.n_kv_heads, model.dims.head_dim, self.spec.predicts, adapter,
                                   self.config.predictor.adapter_path)
        self.solutions = solutions
        self.scorer = scorer  # hillinfer's in-storage scorer (a platform's backend); the numpy reference if None
        # the prefill sources a batch uses (runtime/prefill_chain.py), ahead of computing the prompt
        self.prompt_cache: PromptKVCache | None = None  # set to share prompt KV across engines on this model
        self.context_store = None  # a runtime.store.ContextStore (open_context_store): stored prefixes skip compute
        self.ttft = TTFTOptions(compute_costs=_ttft_costs(self.config.prefill.ttft_costs_path))  # prefill with a stored prefix
        self.prefill_stats: list[dict] = []  # per prompt of the last generate loaded from the store: how it went
        self.events = EventBus()
        if os.environ.get("EDGEKV_EVENTS_FILE"):  # set by `edgekv energy` for the process it measures
            self.events.subscribe(JsonLinesLog(os.environ["EDGEKV_EVENTS_FILE"]))
        self.memory_plan = preflight(policy, self.config, model.dims, model.dtype, adapter, kv_path)
        self.reader: KVReader | None = reader
        if self.spec.on_disk and reader is None:
            self.reader = open_reader(self.config.io.reader_backend, self.config.io.io_queue_depth, n_paths=len(self.kv_paths))
        if self.spec.on_disk and self.config.integrity.verify_fraction < 1:
            log.warning("verify_fraction=%g: %s", self.config.integrity.verify_fraction,
                        "KV records read are not checked against their checksums" if self.config.integrity.verify_fraction == 0
                        else f"a damaged KV record is caught with probability {self.config.integrity.verify_fraction:g} per read")

    @classmethod
    def from_pretrained(
        cls,
        model: str | Path,
        kv_path: str | Path | list | None = None,
        config: RuntimeConfig | dict | str | Path | None = None,
        policy: str = "kvswap",
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
        scorer: InStorageScorer | None = None,
        weights: str | None = None,
        backend: str | None = None,
        *,
        kv_offload_path: str | Path | list | None = None,
    ) -> "Engine":
        """Everything that can be refused is checked before the weights are loaded.

        ``model``: a Hugging Face folder, a ``.gguf`` file (or a folder holding one), or a name
        (``fixture``, ``smollm2``), resolved by ``edgekv.runtime.checkpoints``.
        ``config`` may be a deployed config (with ``solutions``): each batch then runs with the
        solution for its (batch size, context), each checked here against its memory budget, on the device and
        in the dtype it was deployed with unless ``device``/``dtype`` say otherwise (runtime/devices.py).
        ``weights``: the linear layers' format (runtime/weights.py WEIGHT_FORMATS); default: the deployed config's
        when this run computes on its device and dtype, else ``native``.  ``backend``, ``kv_path`` (and its old
        name ``kv_offload_path``): as ``Engine``'s.
        """
        kv_path = _renamed_kv_path(kv_path, kv_offload_path)
        if isinstance(config, (str, Path)):
            config = read_config_file(config)  # once: the solutions and the deployed device come from it
        cfg, solutions = load_deployed(config)
        model_dir = resolve_checkpoint(model)
        hf_cfg = read_model_config(model_dir)
        compute = deployed_compute(config)
        device = resolve_device(device, compute.get("device"))
        dtype = resolve_dtype(device, dtype or synthetic_dtype(model_dir), compute.get("dtype"),
                              compute.get("device"))
        weights = resolve_weights(weights, compute, device, dtype)
        check_weight_format(weights, device, dtype)
        resolve_backend(device, backend)  # a backend the device cannot run is refused before the weights load
        dims = ModelDims.from_config(hf_cfg)
        spec = get_policy(policy)
        adapter = _load_adapter(cfg, policy)
        _ttft_costs(cfg.prefill.ttft_costs_path)  # a bad cost model file is named before the weights load
        preflight(policy, spec.effective_config(cfg), dims, dtype, adapter, kv_path)
        for _, _, sol in solutions or []:
            preflight(policy, spec.effective_config(sol), dims, dtype, _load_adapter(sol, policy), kv_path)
        max_context = max([cfg.max_context] + [s.max_context for _, _, s in solutions or []])
        decoder = load_model(model_dir, device, dtype, max_context, weights)
        return cls(decoder, cfg, policy, kv_path, load_tokenizer(model_dir), adapter, solutions, scorer,
                   backend=backend)

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
                              found.get("align_bytes", self.config.io.io_align_bytes))
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
                for j, m in enumerate(p):
                    _check_text(m["content"], f"prompt {i} message {j} content")
                p = self._apply_chat_template(i, p)
            elif isinstance(p, str):
                if self.tokenizer is None:
                    raise ValueError(f"prompt {i} is a string but {self.model.hf.name_or_path} has no tokenizer; pass token ids")
                _check_text(p, f"prompt {i}")
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
        with self.open_batch(batch, needed) as run:
            cfg = run.cfg
            owners = _prefix_owners(prompts, cfg.G) if cfg.placement.share_prefix else [None] * batch
            filled = [run.join(seq, ids, owners[seq]) for seq, ids in enumerate(prompts)]
            self.prefill_stats = [f.stats for f in filled if f.source == CONTEXT_STORE]
            logits = torch.stack([f.logits for f in filled])
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

    def batch_config(self, batch: int, context: int) -> RuntimeConfig:
        """The solution for this (batch, context) when the config has solutions, else the config."""
        if self.solutions is None:
            return self.config
        return self.spec.effective_config(self.solutions.pick(batch, context))

    def pin_adapter(self, n_tokens: int = 1024, seed: int = 0) -> None:
        """Fit the low-rank K adapter now, on a fixed sequence of ``n_tokens`` seeded token ids, when the config
        names no adapter file: every later batch then predicts with the same projection whatever prompts share it.
        A server does this so one request's prompt never shapes another's picks (fitted on a batch's prompts, the
        projection depends on which requests happened to prefill together)."""
        if not self.spec.predicts or self.config.sigma is None or self.adapters.for_config(self.config) is not None:
            return
        n = max(1, min(n_tokens, self.config.max_context - 1))
        ids = torch.randint(0, self.model.dims.vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
        self.adapters.current = build_adapter(self.model, [ids], self.config.sigma)

    @property
    def adapter(self) -> LowRankAdapter | None:
        """The adapter batches predict with when their config names no file (given, or kept from a fit)."""
        return self.adapters.current

    @property
    def rank(self) -> int:
        return self.adapters.rank(self.config)

    @property
    def policy_env(self) -> PolicyEnv:
        """What a batch builds its policy with: this engine's model, KV paths, reader, scorer and adapters."""
        return PolicyEnv(self.model, self.kv_paths, self.reader, self.scorer, self.adapters.for_config,
                         self.adapters.rank, self._picks_event, self.backend)

    def _picks_event(self, layer, groups, valid) -> None:
        self.events.emit("groups_selected", layer=layer, groups=groups, valid=valid)

    def close(self) -> None:
        if self.reader is not None:
            self.reader.close()
            self.reader = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


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


def _check_text(text, where: str) -> None:
    """Text the tokenizer cannot encode is named with its position: the tokenizer raises a TypeError that does not."""
    why = unencodable(text) if isinstance(text, str) else None
    if why is not None:
        raise ValueError(f"{where}: {why}")


def _is_messages(prompt) -> bool:
    return isinstance(prompt, (list, tuple)) and bool(prompt) and all(isinstance(m, dict) for m in prompt)


def _renamed_kv_path(kv_path, kv_offload_path):
    """``kv_path``, or what the old keyword ``kv_offload_path`` gave (read for one release, with a warning)."""
    if kv_offload_path is None:
        return kv_path
    if kv_path is not None:
        raise TypeError("Engine: kv_path and kv_offload_path (its old name) are both given; pass kv_path only")
    warnings.warn("Engine: the keyword 'kv_offload_path' is now 'kv_path'; rename it (the old name is still read)",
                  DeprecationWarning, stacklevel=3)
    return kv_offload_path


def _load_adapter(cfg: RuntimeConfig, policy: str) -> LowRankAdapter | None:
    return LowRankAdapter.load(cfg.predictor.adapter_path) if cfg.predictor.adapter_path and get_policy(policy).predicts else None


def preflight(policy, cfg: RuntimeConfig, dims: ModelDims, dtype, adapter, kv_path) -> MemoryPlan:
    """Refuse what cannot run (adapter mismatch, over budget, a KV folder that cannot hold records); returns the
    memory plan."""
    if adapter is not None:
        adapter.check(dims.global_view().n_layers, dims.n_kv_heads, dims.head_dim)
        if cfg.sigma is not None and abs(adapter.sigma - cfg.sigma) > 0.5:
            raise ConfigError(
                f"config 'sigma' is {cfg.sigma:g} but the adapter file {cfg.predictor.adapter_path} has sigma {adapter.sigma:g}; "
                "drop 'sigma' or point 'adapter_path' at a matching adapter"
            )
    rank = adapter.rank if adapter else LowRankAdapter.rank_for(dims.n_kv_heads, dims.head_dim, cfg.sigma)
    plan = _plan(policy, cfg, dims, dtype, rank)
    plan.check(cfg.max_kv_mem_mib, policy)
    if get_policy(policy).on_disk:
        for path in kv_path_list(kv_path) or [None]:
            check_kv_path(path)
    return plan


def _plan(policy: str, cfg: RuntimeConfig, dims: ModelDims, dtype: torch.dtype, rank: int) -> MemoryPlan:
    itemsize = torch.empty(0, dtype=dtype).element_size()
    return plan_memory(policy, cfg, dims, itemsize, rank, _record_layout(cfg, dims, dtype).stride_bytes)


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



