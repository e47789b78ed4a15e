"""Loading an unmodified Hugging Face checkpoint and exposing the pieces the runtime drives.

The engine runs its own layer loop (prefill layer by layer, decode one token with the KV
coming from wherever the policy keeps it), so it needs the model's modules, not its
``forward``.  Llama, Qwen2/2.5, Qwen3 and Mistral share one block structure; Qwen3 adds
q/k RMS norms on the head dimension, Qwen2 adds q/k/v biases (inside the Linear layers).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral")


class ModelError(ValueError):
    """The checkpoint cannot be served; the message says why and what to do."""


@dataclass(frozen=True)
class ModelDims:
    n_layers: int
    hidden: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab: int

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
        )


REQUIRED_CONFIG_FIELDS = ("num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size")


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
    return cfg


def check_no_sliding_window(hf_config, max_context: int) -> None:
    """Sliding-window layers would need a different mask; refuse rather than compute wrong attention."""
    layer_types = getattr(hf_config, "layer_types", None) or []
    window = getattr(hf_config, "sliding_window", None)
    if "sliding_attention" in layer_types or (
        hf_config.model_type == "mistral" and window is not None and window < max_context
    ):
        raise ModelError(
            f"{hf_config.model_type} checkpoint uses sliding-window attention (window={window}); "
            f"edgekv serves full attention only: use max_context <= {window} or a checkpoint without sliding_window"
        )


class DecoderModel:
    """The embedding, decoder blocks, final norm and head of a causal LM, plus per-layer helpers."""

    def __init__(self, hf_model: nn.Module):
        self.hf = hf_model
        core = hf_model.model
        cfg = hf_model.config
        self.embed = core.embed_tokens
        self.layers = list(core.layers)
        self.norm = core.norm
        self.lm_head = hf_model.lm_head
        self.rotary = core.rotary_emb
        self.dims = ModelDims.from_config(cfg.to_dict())
        self.scaling = self.layers[0].self_attn.scaling
        self.dtype = self.embed.weight.dtype
        self.device = self.embed.weight.device

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin for integer positions of shape [B, T]."""
        probe = torch.empty(0, dtype=self.dtype, device=self.device)
        return self.rotary(probe, positions)

    def _heads(self, proj: nn.Module, norm: nn.Module | None, h: torch.Tensor, cos, sin) -> torch.Tensor:
        """Project, split heads, optional per-head RMS norm (Qwen3), RoPE: [B, T, hidden] -> [B, heads, T, d]."""
        x = proj(h).view(*h.shape[:-1], -1, self.dims.head_dim)
        if norm is not None:
            x = norm(x)
        return _rotate(x.transpose(1, 2), cos, sin)

    def query(self, layer: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Post-RoPE queries [B, H, T, d] of ``layer`` for hidden states x [B, T, hidden] (before its norm)."""
        block = self.layers[layer]
        attn = block.self_attn
        return self._heads(attn.q_proj, getattr(attn, "q_norm", None), block.input_layernorm(x), cos, sin)

    def qkv(self, layer: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Post-RoPE q [B, H, T, d], k and v [B, H_kv, T, d] of ``layer`` for x [B, T, hidden]."""
        block = self.layers[layer]
        attn = block.self_attn
        h = block.input_layernorm(x)
        q = self._heads(attn.q_proj, getattr(attn, "q_norm", None), h, cos, sin)
        k = self._heads(attn.k_proj, getattr(attn, "k_norm", None), h, cos, sin)
        v = attn.v_proj(h).view(*h.shape[:-1], -1, self.dims.head_dim).transpose(1, 2)
        return q, k, v

    def finish_layer(self, layer: int, x: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """Residual + output projection + MLP; attn_out is [B, H, T, d]."""
        block = self.layers[layer]
        b, _, t, _ = attn_out.shape
        x = x + block.self_attn.o_proj(attn_out.transpose(1, 2).reshape(b, t, -1))
        return x + block.mlp(block.post_attention_layernorm(x))

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(x)).float()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on [B, H, T, d] with cos/sin [B, T, d] (the HF rotate-half convention)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def load_model(model_dir: str | Path, device: torch.device, dtype: torch.dtype, max_context: int) -> DecoderModel:
    """Load a local checkpoint (never from a hub) after checking its architecture."""
    from transformers import AutoConfig, AutoModelForCausalLM

    read_model_config(model_dir)
    hf_config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    check_no_sliding_window(hf_config, max_context)
    hf_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, local_files_only=True)
    hf_model.to(device).eval()
    return DecoderModel(hf_model)
