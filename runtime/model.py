"""Loading an unmodified Hugging Face checkpoint and exposing the pieces the runtime drives.

The engine runs its own layer loop (prefill layer by layer, decode one token with the KV
coming from wherever the policy keeps it), so it needs the model's modules, not its
``forward``.  Llama, Qwen2/2.5, Qwen3 and Mistral share one block structure; Qwen3 adds
q/k RMS norms on the head dimension, Qwen2 adds q/k/v biases (inside the Linear layers).  Gemma 3 adds norms
after attention and around the MLP, a RoPE base per layer type and a scaled embedding (inside its module).

Layers may attend to a sliding window of their last W tokens (Gemma 3's local layers, Mistral's and Qwen2's
``sliding_window``): ``ModelDims.layer_windows`` says which, and the policies see only the global layers
(runtime/hybrid.py keeps the windowed ones in a ring in memory).
"""
from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from .errors import ModelError
from .norms import norm_call
from .weights import (GgmlLinear, block_end, check_weight_format, heads_call, normed_call, packed_call,
                      quantize_linears)

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral", "gemma3_text")
GLOBAL, SLIDING = "full_attention", "sliding_attention"  # transformers' layer_types


@dataclass(frozen=True)
class ModelDims:
    n_layers: int
    hidden: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab: int
    layer_windows: tuple[int, ...] = ()  # per layer: W > 0 attends to its last W tokens, 0 to all; () all global

    @classmethod
    def from_config(cls, cfg: dict) -> "ModelDims":
        """From a checkpoint's config.json contents (no weights needed)."""
        n_heads = cfg["num_attention_heads"]
        return cls(
            n_layers=cfg["num_hidden_layers"],
            hidden=cfg["hidden_size"],
            n_heads=n_heads,
            n_kv_heads=cfg.get("num_key_value_heads") or n_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // n_heads,
            vocab=cfg["vocab_size"],
            layer_windows=layer_windows(cfg),
        )

    def window(self, layer: int) -> int:
        """The layer's sliding window in tokens, 0 for a global layer."""
        return self.layer_windows[layer] if self.layer_windows else 0

    @property
    def global_layers(self) -> tuple[int, ...]:
        """The layers whose KV grows with the context: the ones a KV policy keeps (and offloads)."""
        return tuple(layer for layer in range(self.n_layers) if not self.window(layer))

    @property
    def hybrid(self) -> bool:
        return any(self.layer_windows)

    def global_view(self) -> "ModelDims":
        """The dims a KV policy sees: only the global layers (the same dims for a model without windows)."""
        if not self.hybrid:
            return self
        return ModelDims(len(self.global_layers), self.hidden, self.n_heads, self.n_kv_heads, self.head_dim, self.vocab)

    def window_ring_bytes(self, max_context: int, kv_itemsize: int) -> int:
        """Per sequence: K and V of each windowed layer's last min(W, max_context) tokens."""
        tokens = sum(min(w, max_context) for w in self.layer_windows if w)
        return 2 * tokens * self.n_kv_heads * self.head_dim * kv_itemsize


def layer_windows(cfg: dict) -> tuple[int, ...]:
    """Each layer's sliding window from config.json (0: global), () when every layer is global: ``layer_types``
    where given (Gemma 3, Qwen2 as transformers writes it), else Gemma 3's ``sliding_window_pattern`` (every p-th
    layer global), Qwen2's ``use_sliding_window`` (layers from ``max_window_layers`` on) or Mistral's window on
    every layer."""
    window, n = cfg.get("sliding_window"), cfg["num_hidden_layers"]
    if not window or (cfg.get("model_type") == "qwen2" and not cfg.get("use_sliding_window")):
        return ()
    types = cfg.get("layer_types")
    pattern = cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern")
    if types:
        sliding = [t == SLIDING for t in types]
    elif cfg.get("model_type") == "gemma3_text" and pattern:
        sliding = [(i + 1) % pattern != 0 for i in range(n)]
    elif cfg.get("model_type") == "qwen2":
        sliding = [i >= cfg.get("max_window_layers", n) for i in range(n)]
    elif cfg.get("model_type") == "mistral":
        sliding = [True] * n
    else:
        return ()
    return tuple(window if s else 0 for s in sliding) if any(sliding) else ()


SYNTHETIC_MARKER = "edgekv-synthetic.json"  # a checkpoint folder of random weights (runtime/synth.py)
REQUIRED_CONFIG_FIELDS = ("num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size")
# bytes per element of the safetensors dtypes; a dtype not listed here is bounds-checked only
SAFETENSORS_ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "I16": 2, "F16": 2, "BF16": 2,
                        "U32": 4, "I32": 4, "F32": 4, "U64": 8, "I64": 8, "F64": 8}
MAX_SAFETENSORS_HEADER = 100_000_000  # the safetensors library's own limit
REDOWNLOAD = "the checkpoint is damaged or incomplete: download it again"


def read_model_config(model_dir: str | Path) -> dict:
    """Read and check config.json before any weight is loaded."""
    path = Path(model_dir)
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise ModelError(f"{path} is not a Hugging Face checkpoint folder (no config.json); pass a local model folder")
    try:
        cfg = json.loads(cfg_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelError(f"{cfg_path} is not valid JSON ({exc}); the checkpoint is damaged: download it again") from exc
    if not isinstance(cfg, dict):
        raise ModelError(f"{cfg_path} holds a {type(cfg).__name__}, not a JSON object; the checkpoint is damaged")
    model_type = cfg.get("model_type")
    if model_type == "gemma3" and isinstance(cfg.get("text_config"), dict):
        raise ModelError(f"{cfg_path} is a multimodal Gemma 3 (model_type 'gemma3', a text_config inside); edgekv "
                         "serves its text-only form (model_type 'gemma3_text', e.g. gemma-3-270m or a GGUF of it)")
    if model_type not in SUPPORTED_ARCHITECTURES:
        arch = cfg.get("architectures") or [model_type]
        raise ModelError(
            f"unsupported architecture {arch[0]!r} (model_type={model_type!r}); "
            f"edgekv supports decoder-only RoPE models of types {list(SUPPORTED_ARCHITECTURES)}"
        )
    missing = [key for key in REQUIRED_CONFIG_FIELDS
               if isinstance(cfg.get(key), bool) or not isinstance(cfg.get(key), int) or cfg[key] < 1]
    if missing:
        raise ModelError(f"{cfg_path} lacks positive integer field(s) {missing}; the checkpoint is incomplete: "
                         "download it again")
    for key in ("num_key_value_heads", "head_dim"):  # optional, but a present one must be a size
        value = cfg.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ModelError(f"{cfg_path}: field '{key}' must be a positive integer or absent, got {value!r}; {REDOWNLOAD}")
    window, types = cfg.get("sliding_window"), cfg.get("layer_types")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ModelError(f"{cfg_path}: field 'sliding_window' must be a positive integer or null, got {window!r}; {REDOWNLOAD}")
    if types is not None and (not isinstance(types, list) or len(types) != cfg["num_hidden_layers"]
                              or not set(types) <= {GLOBAL, SLIDING}):
        raise ModelError(f"{cfg_path}: field 'layer_types' must list {cfg['num_hidden_layers']} (num_hidden_layers) "
                         f"entries of {GLOBAL!r} or {SLIDING!r}, got {str(types)[:120]}; {REDOWNLOAD}")
    if types and SLIDING in types and not window:
        raise ModelError(f"{cfg_path}: layer_types names {SLIDING!r} layers but 'sliding_window' is {window!r}; {REDOWNLOAD}")
    if cfg.get("attn_logit_softcapping"):
        raise ModelError(f"{cfg_path}: attention logit soft-capping (attn_logit_softcapping="
                         f"{cfg['attn_logit_softcapping']}) is not served (Gemma 2); use a checkpoint without it")
    heads, kv_heads = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    if heads % kv_heads:
        raise ModelError(f"{cfg_path}: num_attention_heads ({heads}) is not a multiple of num_key_value_heads "
                         f"({kv_heads}); {REDOWNLOAD}")
    if not cfg.get("head_dim") and cfg["hidden_size"] % heads:
        raise ModelError(f"{cfg_path}: hidden_size ({cfg['hidden_size']}) is not a multiple of num_attention_heads "
                         f"({heads}) and no head_dim is given; {REDOWNLOAD}")
    return cfg


def safetensors_header(path: Path) -> dict:
    """The tensor table of a .safetensors file, checked against the file's size before any weight is read: a
    truncated download, another file under the name or a header claiming bytes the file lacks is named here
    instead of surfacing as the library's "Error while deserializing header"."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ModelError(f"{path} is {size} bytes, too short for a safetensors file; {REDOWNLOAD}")
        n = struct.unpack("<Q", head)[0]
        if n > min(size - 8, MAX_SAFETENSORS_HEADER):
            raise ModelError(f"{path}: its header claims {n} bytes but the file has {size}: not a safetensors file, "
                             f"or cut short; {REDOWNLOAD}")
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelError(f"{path}: its header is not JSON ({exc}); not a safetensors file, {REDOWNLOAD}") from exc
    if not isinstance(header, dict):
        raise ModelError(f"{path}: its header is a JSON {type(header).__name__}, not a tensor table; {REDOWNLOAD}")
    data_bytes = size - 8 - n
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
            ok = isinstance(dtype, str) and begin <= end and all(
                isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in [*shape, begin, end])
        except (TypeError, KeyError, ValueError):
            ok = False
        if not ok:
            raise ModelError(f"{path}: tensor {name!r} has a malformed entry {entry!r:.120}; {REDOWNLOAD}")
        if end > data_bytes:
            raise ModelError(f"{path}: tensor {name!r} lies at bytes {begin}..{end} of a data area of {data_bytes}: "
                             f"the file is cut short; {REDOWNLOAD}")
        need = math.prod(shape) * SAFETENSORS_ITEMSIZE.get(dtype, 0)
        if dtype in SAFETENSORS_ITEMSIZE and end - begin != need:
            raise ModelError(f"{path}: tensor {name!r} ({dtype} {shape}) needs {need} bytes but its header gives it "
                             f"{end - begin}; {REDOWNLOAD}")
    return header


def weight_headers(model_dir: str | Path) -> dict[Path, dict]:
    """Each safetensors file of a checkpoint with its tensor table ({} for pytorch_model.bin checkpoints, which
    transformers reads itself), as transformers would pick them: model.safetensors, else the shards that
    model.safetensors.index.json names, each of which must exist and hold the tensors it is named for."""
    folder = Path(model_dir)
    single, index = folder / "model.safetensors", folder / "model.safetensors.index.json"
    if single.is_file():
        return {single: safetensors_header(single)}
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise TypeError("weight_map must map tensor names to file names")
        except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ModelError(f"{index} is not a shard index ({type(exc).__name__}: {exc}); {REDOWNLOAD}") from exc
        headers = {}
        for shard in sorted(set(weight_map.values())):
            path = folder / shard
            if not path.is_file():
                raise ModelError(f"{path} is missing (named by {index.name}); {REDOWNLOAD}")
            headers[path] = safetensors_header(path)
        lost = next((t for t, shard in weight_map.items() if t not in headers[folder / shard]), None)
        if lost is not None:
            raise ModelError(f"{index.name} puts tensor {lost!r} in {weight_map[lost]}, which lacks it; {REDOWNLOAD}")
        return headers
    if any((folder / n).is_file() for n in ("pytorch_model.bin", "pytorch_model.bin.index.json")):
        return {}
    raise ModelError(f"{folder} holds no weights (model.safetensors, or model.safetensors.index.json and its shards); "
                     f"{REDOWNLOAD}")


def check_weights(model_dir: str | Path, cfg: dict) -> None:
    """The weight files are whole and their embedding is the size config.json says (a config.json from another
    model would otherwise build a model of the wrong size and fail deep inside transformers)."""
    headers = weight_headers(model_dir)
    for path, header in headers.items():
        entry = header.get("model.embed_tokens.weight")
        if entry is not None and list(entry["shape"]) != [cfg["vocab_size"], cfg["hidden_size"]]:
            raise ModelError(f"{path}: model.embed_tokens.weight is {entry['shape']} but {Path(model_dir) / 'config.json'} "
                             f"says vocab_size={cfg['vocab_size']}, hidden_size={cfg['hidden_size']}: the config and the "
                             "weights are of different models; download the checkpoint again")


class DecoderModel:
    """The embedding, decoder blocks, final norm and head of a causal LM, plus per-layer helpers."""

    def __init__(self, hf_model: nn.Module, synthetic: bool = False, weights: str = "native"):
        self.hf = hf_model
        self.synthetic = synthetic  # random weights in a real shape: its timings count, its tokens do not
        self.weights = weights  # runtime/weights.py WEIGHT_FORMATS: the linear layers' format
        core = hf_model.model
        cfg = hf_model.config
        self.embed = core.embed_tokens
        self.layers = list(core.layers)
        self.plans = [LayerPlan(block) for block in self.layers]
        self._shared_kernels = [k for m in hf_model.modules() if isinstance(m, GgmlLinear) for k in m.kernels]
        self._aside_lender = None
        self.norm = core.norm
        self._final_norm = norm_call(core.norm)
        self.lm_head = hf_model.lm_head
        self.rotary = core.rotary_emb
        self.dims = ModelDims.from_config(cfg.to_dict())
        self.scaling = self.layers[0].self_attn.scaling
        self.dtype = self.embed.weight.dtype
        self.device = self.embed.weight.device
        # Gemma 3: one RoPE base per layer type (its rotary module takes the type), else one for all layers
        self._rope_types = getattr(self.rotary, "layer_types", None)
        self.layer_types = list(getattr(cfg, "layer_types", None) or [GLOBAL] * self.dims.n_layers)
        self.softcap = getattr(cfg, "final_logit_softcapping", None)

    @property
    def computes_aside(self) -> bool:
        """Whether its linear layers share their rows with a decode step's helper thread (weights 'ggml'): the step
        leaves torch one core."""
        return bool(self._shared_kernels)

    def lend_aside(self, aside, lender) -> None:
        """A decode step's helper thread (runtime/aside.py) for the linear layers that share their rows with one
        (weights 'ggml'), lent by ``lender`` (a policy); ``aside`` None withdraws it, if ``lender`` lent it.  One
        lender at a time: a second policy on the model computes its layers on its own thread."""
        if aside is not None and self._aside_lender is None:
            self._aside_lender = lender
        elif aside is not None or self._aside_lender is not lender:
            return
        else:
            self._aside_lender = None
        for kernel in self._shared_kernels:
            kernel.aside = aside

    def rope(self, positions: torch.Tensor) -> "Rope":
        """cos/sin for integer positions of shape [B, T], per layer type where the model has several bases."""
        probe = torch.empty(0, dtype=self.dtype, device=self.device)
        if not self._rope_types:
            return Rope({None: rope_pair(*self.rotary(probe, positions))}, None)
        return Rope({t: rope_pair(*self.rotary(probe, positions, t)) for t in self._rope_types}, self.layer_types)

    def _heads(self, projected: torch.Tensor, norm, cos, sin) -> torch.Tensor:
        """Split a projection [B, T, heads * d] into heads, optional per-head RMS norm (Qwen3's, a module or its
        forward), RoPE: -> [B, heads, T, d]."""
        x = projected.view(*projected.shape[:-1], -1, self.dims.head_dim)
        if norm is not None:
            x = norm(x)
        return _rotate(x.transpose(1, 2), cos, sin)

    def query(self, layer: int, x: torch.Tensor, rope: "Rope") -> torch.Tensor:
        """Post-RoPE queries [B, H, T, d] of ``layer`` for hidden states x [B, T, hidden] (before its norm)."""
        plan = self.plans[layer]
        if plan.q_heads is not None:
            heads = plan.q_heads(x, *rope.at(layer))
            if heads is not None:
                return heads[0]
        return self._heads(plan.q_proj(x), plan.q_norm, *rope.at(layer))

    def qkv(self, layer: int, x: torch.Tensor, rope: "Rope"):
        """Post-RoPE q [B, H, T, d], k and v [B, H_kv, T, d] of ``layer`` for x [B, T, hidden]."""
        plan = self.plans[layer]
        cos, sin = rope.at(layer)
        if plan.qkv_heads is not None:  # weights 'ggml': one native call
            heads = plan.qkv_heads(x, cos, sin)
            if heads is not None:
                return heads
        if plan.qkv_whole is not None:  # packed, no q/k norms: q's and k's heads side by side, rotated in one pass
            y = plan.qkv_whole(x)
            q, k = self._heads(y[..., : plan.qk_columns], None, cos, sin).split(plan.qk_heads, dim=1)
            v = y[..., plan.qk_columns :]
        else:
            q, k, v = plan.qkv(x)  # int4: one call for all three
            q = self._heads(q, plan.q_norm, cos, sin)
            k = self._heads(k, plan.k_norm, cos, sin)
        return q, k, v.view(*x.shape[:-1], -1, self.dims.head_dim).transpose(1, 2)

    def finish_layer(self, layer: int, x: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """Residual + output projection + MLP; attn_out is [B, H, T, d]."""
        plan = self.plans[layer]
        if plan.block_end is not None:  # weights 'ggml': one native call
            out = plan.block_end(x, attn_out)
            if out is not None:
                return out
        b, _, t, _ = attn_out.shape
        out = plan.o_proj(attn_out.transpose(1, 2).reshape(b, t, -1))
        if plan.gemma:
            x = x + plan.post_attention_norm(out)
            return x + plan.post_ff_norm(plan.mlp_out(x))
        x = x + out
        return x + plan.mlp_out(x)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head.forward(self._final_norm(x)).float()
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


class LayerPlan:
    """One block's modules as the decode path calls them, resolved once: bound ``forward`` methods (no
    ``nn.Module.__call__`` or attribute lookups through ``nn.Module.__getattr__`` per call, nothing here hooks a
    module), and the packed layers (runtime/weights.py ``PackedSlice``) as one call and the slices it is cut into.
    On a 2-core CPU a decode step does little else but dispatch per token: SmolLM2 1K, full, int4, 1.08x the tok/s
    of looking them up per call."""

    def __init__(self, block: nn.Module):
        attn, mlp = block.self_attn, block.mlp
        inputs = block.input_layernorm  # the attention's input norm, taken by the projections' calls
        self.qkv, packed = packed_call(attn.q_proj, attn.k_proj, attn.v_proj, norm=inputs)
        self.q_norm, self.k_norm = (norm_call(getattr(attn, n, None)) for n in ("q_norm", "k_norm"))
        # a packed q/k/v layer of a model without q/k norms: its whole output, and q's and k's columns and heads
        whole = packed and self.q_norm is None and self.k_norm is None
        self.qkv_whole = normed_call(inputs, attn.q_proj.fused) if whole else None
        self.qk_columns = attn.q_proj.out_features + attn.k_proj.out_features
        self.qk_heads = [attn.q_proj.out_features // attn.head_dim, attn.k_proj.out_features // attn.head_dim]
        self.q_proj, self.o_proj = normed_call(inputs, attn.q_proj), attn.o_proj.forward
        # weights 'ggml': the projections, their heads and RoPE in one native call (packed q/k/v, and q's rows)
        self.qkv_heads = heads_call(attn.q_proj.fused, inputs, attn.head_dim, *self.qk_heads) if whole else None
        self.q_heads = heads_call(attn.q_proj, inputs, attn.head_dim, self.qk_heads[0]) if self.q_norm is None \
            else None
        self.gemma = hasattr(block, "pre_feedforward_layernorm")  # normed attention and MLP outputs
        if self.gemma:
            self.post_attention_norm = norm_call(block.post_attention_layernorm)
            self.post_ff_norm = norm_call(block.post_feedforward_layernorm)
        mlp_norm = block.pre_feedforward_layernorm if self.gemma else block.post_attention_layernorm
        gate_up, packed = packed_call(mlp.gate_proj, mlp.up_proj, norm=mlp_norm) if hasattr(mlp, "gate_proj") \
            else (None, False)
        self.mlp = normed_call(mlp_norm, mlp)
        self.packed_mlp = (gate_up, mlp.act_fn.forward, mlp.down_proj.forward) if packed else None
        self.block_end = block_end(attn.o_proj, mlp, mlp_norm) if packed and not self.gemma else None

    def mlp_out(self, x: torch.Tensor) -> torch.Tensor:
        """The gated MLP of x before its norm; with gate and up packed as one layer (int4, ggml), one call for both
        (under ggml, the norm in it)."""
        if self.packed_mlp is None:
            return self.mlp(x)
        gate_up, act, down = self.packed_mlp
        gate, up = gate_up(x)
        return down(act(gate) * up)


class Rope:
    """cos/sin at some positions for each layer type (one pair unless the model has a base per type), as
    ``rope_pair`` prepares them."""

    def __init__(self, pairs: dict, layer_types: list[str] | None):
        self.pairs, self.layer_types = pairs, layer_types

    def at(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.pairs[self.layer_types[layer] if self.layer_types else None]


def rope_pair(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's cos/sin [B, T, d] as ``_rotate`` takes them, once a step rather than once a rotation: a head axis, and
    sin's first half negated (rotate-half's sign; a negation is exact, so the result is HF's to the bit)."""
    sign = torch.ones(sin.shape[-1], dtype=sin.dtype, device=sin.device)
    sign[: sin.shape[-1] // 2] = -1
    return cos.unsqueeze(1), (sin * sign).unsqueeze(1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """RoPE on [B, H, T, d] (the HF rotate-half convention) with ``rope_pair``'s cos/sin: rotating half is a roll
    by d/2 with the sign in sin, four calls where a cat of two negated halves took ten."""
    return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * signed_sin


def _random_model(auto, hf_config, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """The architecture with random weights allocated on ``device`` directly (an 8B model never passes through host
    memory): built on the meta device, then every tensor filled there (norms 1, biases 0, the rest N(0, 0.02));
    RoPE's frequencies, which are buffers computed at construction, are built again on the device."""
    with torch.device("meta"):
        model = auto.from_config(hf_config, dtype=dtype)
    model.to_empty(device=device)
    model.tie_weights()  # to_empty gives every parameter its own storage: a tied head is tied again
    generator = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            if "norm" in name:
                tensor.fill_(1.0)
            elif name.endswith(".bias"):
                tensor.zero_()
            else:
                tensor.normal_(0.0, 0.02, generator=generator)
    model.model.rotary_emb = type(model.model.rotary_emb)(hf_config).to(device)  # its float32 buffers, as loaded
    return model.eval()


def load_model(model_dir: str | Path, device: torch.device, dtype: torch.dtype, max_context: int,
               weights: str = "native") -> DecoderModel:
    """Load a local checkpoint (never from a hub) after checking its architecture; a synthetic one
    (runtime/synth.py) gets random weights built on ``device``.  ``weights``: runtime/weights.py WEIGHT_FORMATS."""
    from transformers import AutoConfig, AutoModelForCausalLM

    check_weight_format(weights, device, dtype)
    cfg = read_model_config(model_dir)
    hf_config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    if (Path(model_dir) / SYNTHETIC_MARKER).is_file():
        model = _random_model(AutoModelForCausalLM, hf_config, device, dtype)
        return DecoderModel(quantize_linears(model, weights), synthetic=True, weights=weights)
    check_weights(model_dir, cfg)
    hf_model, info = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, local_files_only=True,
                                                          output_loading_info=True, ignore_mismatched_sizes=True)
    # transformers fills a missing or misshapen tensor with random values and only logs it: refuse instead
    wrong = sorted(info["missing_keys"]) + sorted(f"{k} ({tuple(old)} on disk, {tuple(new)} expected)"
                                                  for k, old, new in info["mismatched_keys"])
    if wrong:
        raise ModelError(f"{model_dir}: the weights lack or misshape {len(wrong)} tensor(s) the config.json model has "
                         f"({', '.join(wrong[:4])}{', ...' if len(wrong) > 4 else ''}); {REDOWNLOAD}")
    hf_model.to(device).eval()
    return DecoderModel(quantize_linears(hf_model, weights), weights=weights)
