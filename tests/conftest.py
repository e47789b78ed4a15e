"""Shared fixtures: small random-weight checkpoints saved with save_pretrained, and KV folders."""
from __future__ import annotations

import os

import pytest
import torch

SMALL = dict(
    vocab_size=160,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
)


def save_model(path, arch: str, **overrides):
    """Save a random model of ``arch`` (llama, qwen2, qwen3, mistral) into ``path``; returns the folder."""
    from transformers import (
        LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM,
        Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM,
    )

    classes = {
        "llama": (LlamaConfig, LlamaForCausalLM, {}),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
        "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"head_dim": 16}),
        "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": None}),
    }
    config_cls, model_cls, extra = classes[arch]
    torch.manual_seed(1234)
    model = model_cls(config_cls(**{**SMALL, **extra, **overrides}))
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {arch: save_model(root / arch, arch) for arch in ("llama", "qwen2", "qwen3", "mistral")}


@pytest.fixture
def kv_dir(tmp_path):
    path = tmp_path / "kv"
    path.mkdir()
    return path


def files_under(path) -> list[str]:
    return [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs] + [
        os.path.join(d, s) for d, ss, _ in os.walk(path) for s in ss
    ]
