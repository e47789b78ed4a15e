"""Every policy on unusual but valid models is exact against Hugging Face greedy decoding, and a failing
prefill or decode step surfaces its own error, leaves no KV file open or on disk and leaves the engine usable."""
from __future__ import annotations

import itertools
import os
import threading
import time

import pytest
import torch

from edgekv.runtime import Engine
from edgekv.runtime.disk_store import DiskKVStore
from edgekv.runtime.offload import OffloadedKV
from tests.conftest import files_under, save_model

PROMPT = list(range(3, 40))  # 37 tokens: not a multiple of G
NEW_TOKENS = 8
EXACT = {"G": 4, "M": 16, "C": 16, "max_context": 64, "max_batch": 1, "sigma": 4}  # every group selected
POLICIES = {
    "full": ("full", {}),
    "kvswap": ("kvswap", {}),
    "kvswap-noreuse": ("kvswap", {"reuse": False}),
    "kvswap-sinks-window": ("kvswap", {"sink_tokens": 4, "window_tokens": 8}),  # the ring wraps 3 times
    "kvswap-int8-klr": ("kvswap", {"klr_dtype": "int8", "window_tokens": 4}),
    "kvswap-int4-klr": ("kvswap", {"klr_dtype": "int4", "sigma": 3}),  # an odd rank: a half-empty last byte
    "kvswap-oracle": ("kvswap", {"selector": "oracle", "score_reduce": "softmax", "sigma": 1, "window_tokens": 4}),
    "kvswap-corrected": ("kvswap", {"correction": "corrected", "window_tokens": 4}),
    "kvswap-prompt-adapter": ("kvswap", {"prompt_adapter": True}),  # the prompt's 36 stored keys fit rank H_kv*d/4
    "token": ("token", {}),
    "token-sinks-window": ("token", {"sink_tokens": 3, "window_tokens": 5}),
    "kvswap-clustered-cost": ("kvswap", {"clustering": True, "replacement": "cost", "recluster_steps": 3,
                                         "cluster_queries": 8, "max_request_bytes": 16384}),
    "flexgen": ("flexgen", {}),
    "hillinfer": ("hillinfer", {"importance_rate": 1.0, "score_block_tokens": 16}),  # alpha = 1 selects every token
}
MODELS = {  # name -> (arch, save_model overrides)
    "1-layer": ("llama", {"num_hidden_layers": 1}),
    "2-layers": ("llama", {"num_hidden_layers": 2}),
    "3-layers": ("llama", {"num_hidden_layers": 3}),
    "5-layers": ("llama", {"num_hidden_layers": 5}),
    "mha": ("llama", {"num_hidden_layers": 3, "num_key_value_heads": 4}),
    "qwen2-bias": ("qwen2", {"num_hidden_layers": 3}),
    "head-dim-128": ("llama", {"num_hidden_layers": 3, "hidden_size": 256, "num_attention_heads": 2,
                               "num_key_value_heads": 1}),
    # hybrid attention (window 8 tokens, so the 45-token sequences wrap each local layer's ring): Gemma 3's own
    # pattern, odd layer counts, a global first layer, no global layer at all; Mistral's and Qwen2's windows
    "gemma3-6": ("gemma3", {"num_hidden_layers": 6}),  # five local layers, then a global one
    "gemma3-LLG": ("gemma3", {"num_hidden_layers": 3, "layer_types": ["sliding_attention"] * 2 + ["full_attention"]}),
    "gemma3-GLLGL": ("gemma3", {"num_hidden_layers": 5, "layer_types": [
        "full_attention", "sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]}),
    "gemma3-L": ("gemma3", {"num_hidden_layers": 1, "layer_types": ["sliding_attention"]}),
    "mistral-window": ("mistral", {"num_hidden_layers": 3, "sliding_window": 8}),
    "qwen2-window": ("qwen2", {"num_hidden_layers": 3, "use_sliding_window": True, "sliding_window": 8,
                               "max_window_layers": 1}),
}


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    """Per model: its folder and Hugging Face's own greedy continuation of PROMPT."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("matrix")
    out = {}
    for name, (arch, overrides) in MODELS.items():
        folder = save_model(root / name, arch, **overrides)
        hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        expected = hf.generate(torch.tensor([PROMPT]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None)
        out[name] = (folder, expected[0, len(PROMPT):].tolist())
    return out


@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("model", list(MODELS))
def test_every_policy_matches_hf_greedy(matrix, kv_path, model, policy):
    folder, expected = matrix[model]
    name, overrides = POLICIES[policy]
    with Engine.from_pretrained(folder, kv_path=kv_path, config={**EXACT, **overrides}, policy=name,
                                device="cpu") as engine:
        result = engine.generate([PROMPT], max_new_tokens=NEW_TOKENS, stop_token_ids=[])[0]
        assert result.stats["kv_resident_bytes"] == engine.memory_plan.total_bytes  # the plan counts the buffers made
    assert result.token_ids == expected
    assert files_under(kv_path) == []


@pytest.mark.parametrize("model", ["2-layers", "qwen2-bias", "gemma3-6", "mistral-window"])
def test_teacher_forced_logits_through_the_runtimes_calls_are_hf_s(matrix, model):
    # what install/weights.py scores a weight format by: the runtime's own layer calls over a whole window
    from transformers import AutoModelForCausalLM

    from edgekv.runtime.forward import teacher_forced_logits
    from edgekv.runtime.model import load_model

    folder = matrix[model][0]
    ids = PROMPT + PROMPT[:8]  # 45 tokens: past a local layer's window of 8
    want = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)(torch.tensor([ids])).logits[0]
    got = teacher_forced_logits(load_model(folder, torch.device("cpu"), torch.float32, 64), ids)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


class Injected(RuntimeError):
    pass


def open_files_under(path) -> list[str]:
    """This process's open files under ``path``, deleted ones included."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except FileNotFoundError:  # the listing's own fd, closed since
            continue
        if target.startswith(str(path)):
            found.append(target)
    return found


def _slow_reads(monkeypatch):
    """Reads take a while, so one is still in flight when a step fails (the case that used to be masked)."""
    real = DiskKVStore.read

    def read(self, batch):
        time.sleep(0.05)
        real(self, batch)

    monkeypatch.setattr(DiskKVStore, "read", read)


def _fail_at_layer_1(method: str):
    """An injector: ``OffloadedKV.<method>`` raises when called for layer 1 (after layer 0's work started)."""
    def inject(monkeypatch):
        real = getattr(OffloadedKV, method)

        def failing(self, layer, *args):
            if layer == 1:
                raise Injected(f"injected in {method}")
            return real(self, layer, *args)

        monkeypatch.setattr(OffloadedKV, method, failing)

    inject.__name__ = f"fail_{method}_of_layer_1"
    return inject


def _fail_opening_layer_2(monkeypatch):
    """Fails in prefill, with the files of layers 0 and 1 already open."""
    real = DiskKVStore._open

    def open_(self, path):
        if path.name.endswith("layer2.kv"):
            raise Injected("injected opening a KV file")
        return real(self, path)

    monkeypatch.setattr(DiskKVStore, "_open", open_)


def _fail_reads(monkeypatch):
    def read(self, batch):
        assert threading.current_thread().name.startswith("ekv-io")
        raise Injected("injected in a read on the I/O thread")

    monkeypatch.setattr(DiskKVStore, "read", read)


@pytest.mark.parametrize("inject", [_fail_opening_layer_2, _fail_at_layer_1("prefetch"), _fail_reads,
                                    _fail_at_layer_1("attend")], ids=lambda f: f.__name__)
@pytest.mark.parametrize("policy", ["kvswap", "kvswap-noreuse", "flexgen", "hillinfer"])
def test_a_failing_step_surfaces_its_own_error(matrix, kv_path, monkeypatch, inject, policy):
    folder, expected = matrix["3-layers"]
    name, overrides = POLICIES[policy]
    with Engine.from_pretrained(folder, kv_path=kv_path, config={**EXACT, **overrides}, policy=name,
                                device="cpu") as engine:
        with monkeypatch.context() as patch:
            _slow_reads(patch)
            inject(patch)
            with pytest.raises(Injected, match="injected"):
                engine.generate([PROMPT], max_new_tokens=NEW_TOKENS, stop_token_ids=[])
        assert files_under(kv_path) == [] and open_files_under(kv_path) == []
        after = engine.generate([PROMPT], max_new_tokens=NEW_TOKENS, stop_token_ids=[])[0]  # still usable
    assert after.token_ids == expected


@pytest.mark.parametrize("policy", ["kvswap", "token"])
@pytest.mark.parametrize("pattern", ["".join(p) for p in itertools.product("LG", repeat=3)])
def test_every_local_global_pattern_matches_hf_greedy(tmp_path, kv_path, pattern, policy):
    """Three Gemma 3 layers in each local (L) / global (G) arrangement: the policy holds exactly the global ones
    (its KV files, its memory) and the tokens are Hugging Face's."""
    from transformers import AutoModelForCausalLM

    types = ["sliding_attention" if c == "L" else "full_attention" for c in pattern]
    folder = save_model(tmp_path / pattern, "gemma3", num_hidden_layers=3, layer_types=types)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    expected = hf.generate(torch.tensor([PROMPT]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None)
    with Engine.from_pretrained(folder, kv_path=kv_path, config=EXACT, policy=policy, device="cpu") as engine:
        result = engine.generate([PROMPT], max_new_tokens=NEW_TOKENS, stop_token_ids=[])[0]
        window = engine.memory_plan.per_sequence_bytes.get("window_ring", 0)
        assert window == 2 * pattern.count("L") * 8 * 2 * 16 * 4  # K+V x local layers x W x H_kv x d x fp32
        assert result.stats["kv_window_bytes"] == window
        assert result.stats["kv_resident_bytes"] == engine.memory_plan.total_bytes
    assert result.token_ids == expected[0, len(PROMPT):].tolist()
