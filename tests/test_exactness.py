"""With every group selected (M*G >= context), the disk policies must compute exactly what `full` does."""
import pytest
import torch

from edgekv.runtime import Engine
from tests.conftest import files_under

PROMPTS = [list(range(3, 60)), [7, 9, 11] * 30 + [5], list(range(100, 121))]  # ragged: 57, 91, 21 tokens
EXACT = {"G": 4, "M": 64, "C": 64, "max_context": 256, "max_batch": 3, "sigma": 4}


def run(model_dir, kv_path, policy, config=EXACT, **kw):
    with Engine.from_pretrained(model_dir, kv_path=kv_path, config=config,
                                policy=policy, device="cpu") as engine:
        results = engine.generate(PROMPTS, max_new_tokens=14, stop_token_ids=[], output_logits=True, **kw)
    assert files_under(kv_path) == [], "released sequences must leave no KV files"
    return results


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("policy", ["kvswap", "token", "flexgen"])
def test_disk_policies_match_full(model_dirs, kv_path, arch, policy):
    reference = run(model_dirs[arch], kv_path, "full")
    results = run(model_dirs[arch], kv_path, policy)
    for ref, got in zip(reference, results):
        assert got.token_ids == ref.token_ids
        torch.testing.assert_close(got.logits, ref.logits, rtol=1e-4, atol=1e-4)
        assert got.stats["kv_bytes_read"] > 0


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_full_matches_hf_generate(model_dirs, kv_path, arch):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dirs[arch], dtype=torch.float32)
    results = run(model_dirs[arch], kv_path, "full")
    for prompt, result in zip(PROMPTS, results):
        expected = hf.generate(torch.tensor([prompt]), max_new_tokens=14, do_sample=False, eos_token_id=None)
        assert result.token_ids == expected[0, len(prompt):].tolist()


def test_reuse_switch_keeps_exactness_and_the_rolling_buffer_is_what_attends_the_partial_group(model_dirs, kv_path):
    reference = run(model_dirs["llama"], kv_path, "full")
    no_reuse = run(model_dirs["llama"], kv_path, "kvswap", config={**EXACT, "reuse": False})
    assert [r.token_ids for r in no_reuse] == [r.token_ids for r in reference]
    assert all(r.stats["reuse_rate"] == 0 for r in no_reuse)
    # without the rolling buffer the newest, not yet full group is not attended (KVSwap's ablation): not exact
    no_rolling = run(model_dirs["llama"], kv_path, "kvswap", config={**EXACT, "rolling_buffer": False})
    assert any(not torch.allclose(got.logits, ref.logits, rtol=1e-3, atol=1e-3) for got, ref in zip(no_rolling, reference))


def test_reuse_saves_reads_without_changing_tokens(model_dirs, kv_path):
    config = {**EXACT, "M": 6, "C": 12}
    with_reuse = run(model_dirs["llama"], kv_path, "kvswap", config=config)
    without = run(model_dirs["llama"], kv_path, "kvswap", config={**config, "reuse": False})
    assert [r.token_ids for r in with_reuse] == [r.token_ids for r in without]
    for a, b in zip(with_reuse, without):
        assert a.stats["reuse_rate"] > 0
        assert a.stats["kv_bytes_read"] < b.stats["kv_bytes_read"]


def test_full_attends_the_exact_span_on_a_cpu_and_a_few_shapes_on_a_gpu():
    """On a GPU the span is rounded up (masked) so cuDNN meets a shape it has built a graph for; never past the
    cache, never short of the newest token."""
    from edgekv.runtime.kv_policy import CUDA_SPAN_TOKENS, attended_span

    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert [attended_span(n, 640, cpu) for n in (0, 299, 639)] == [1, 300, 640]
    assert [attended_span(n, 640, gpu) for n in (0, 255, 256, 299, 639)] == [256, 256, 512, 512, 640]
    assert len({attended_span(n, 10**6, gpu) for n in range(1000, 1000 + CUDA_SPAN_TOKENS)}) <= 2
