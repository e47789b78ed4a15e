"""Synthetic checkpoints: random weights in the exact shape of a named architecture (``--model synth:NAME``).

Speed and memory depend on shapes, not on trained values, so a bench of an 8B model needs no 16 GB download;
quality is measured on real checkpoints only.  The shapes are those of the public config.json files; the folder
(in the cache) holds that config and a marker, no weights: ``load_model`` initialises them on the device.  Every
output that reports a run says the weights were synthetic.
"""
from __future__ import annotations

import json
from pathlib import Path

from .model import SYNTHETIC_MARKER as MARKER, ModelError

PREFIX = "synth:"

_LLAMA3 = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "rms_norm_eps": 1e-5,
           "rope_theta": 500000.0, "hidden_act": "silu", "max_position_embeddings": 131072, "attention_bias": False,
           "mlp_bias": False, "bos_token_id": 128000, "eos_token_id": 128001}
ARCHITECTURES = {
    "llama-3.2-1b": {**_LLAMA3, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
                     "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64, "tie_word_embeddings": True,
                     "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}},
    "llama-3.2-3b": {**_LLAMA3, "hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 28,
                     "num_attention_heads": 24, "num_key_value_heads": 8, "head_dim": 128, "tie_word_embeddings": True,
                     "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}},
    "llama-3.1-8b": {**_LLAMA3, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                     "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "tie_word_embeddings": False,
                     "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}},
    "qwen2.5-7b": {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "vocab_size": 152064,
                   "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
                   "num_key_value_heads": 4, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "hidden_act": "silu",
                   "max_position_embeddings": 131072, "tie_word_embeddings": False, "use_sliding_window": False,
                   "sliding_window": 131072, "bos_token_id": 151643, "eos_token_id": 151643},
}


def synth_checkpoint(name: str, cache: Path) -> Path:
    """The folder of ``synth:NAME`` under the cache (its config.json and the marker), written on first use."""
    arch = name.removeprefix(PREFIX)
    if arch not in ARCHITECTURES:
        raise ModelError(f"no synthetic architecture {arch!r}; pick one of {sorted(ARCHITECTURES)} (synth:NAME)")
    folder = cache / "synth" / arch
    config = {**ARCHITECTURES[arch], "torch_dtype": "bfloat16"}
    if not (folder / MARKER).is_file() or json.loads((folder / "config.json").read_text()) != config:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text(json.dumps(config, indent=1))
        (folder / MARKER).write_text(json.dumps({"architecture": arch, "weights": "random (synthetic): speed and "
                                                 "memory measurements only, no quality"}))
    return folder


def is_synthetic(model_dir: str | Path) -> bool:
    return (Path(model_dir) / MARKER).is_file()


def synthetic_dtype(model_dir: str | Path) -> str | None:
    """bfloat16 for synthetic weights unless a dtype is named: the published checkpoints' own, on the CPU too
    (an 8B model in float32 would need 32 GB to measure what its bf16 deployment does); None for real ones."""
    return "bfloat16" if is_synthetic(model_dir) else None
