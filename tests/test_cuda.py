"""The device suite (marker ``cuda``; skipped without a CUDA GPU, run by ``make gpu-check``): every policy and
feature on the GPU gives the CPU's greedy tokens in float32, and Hugging Face's greedy tokens in float16/bfloat16
on the same GPU.  The shipped fixture is a trained model, so its greedy choices have margins a change of device
(another order of float additions) does not flip."""
import pytest
import torch

from edgekv.runtime import Engine
from edgekv.runtime.adapter import LowRankAdapter
from edgekv.runtime.devices import resolve_device, resolve_dtype
from edgekv.runtime.ttft.prefill import TTFTOptions
from tests.conftest import save_model

pytestmark = pytest.mark.cuda

NEW_TOKENS = 12
BASE = {"G": 4, "M": 24, "C": 48, "max_context": 640, "max_batch": 2}
PROMPTS = [[(i * 7) % 250 + 4 for i in range(400)], [(i * 13) % 250 + 4 for i in range(333)]]  # 333: not a multiple of G
CASES = {
    "full": ("full", {}),
    "kvswap": ("kvswap", {}),
    "kvswap-sinks-window": ("kvswap", {"sink_tokens": 4, "window_tokens": 16}),
    "kvswap-int8-records": ("kvswap", {"kv_record_dtype": "int8"}),
    "kvswap-int4-records": ("kvswap", {"kv_record_dtype": "int4"}),
    "kvswap-int8-klr": ("kvswap", {"klr_dtype": "int8"}),
    "kvswap-int4-klr": ("kvswap", {"klr_dtype": "int4"}),
    "kvswap-no-reuse": ("kvswap", {"reuse": False}),
    "kvswap-oracle": ("kvswap", {"selector": "oracle", "sigma": 1, "score_reduce": "softmax"}),
    "kvswap-corrected": ("kvswap", {"correction": "corrected"}),
    "kvswap-corrected-capped-no-reuse": ("kvswap", {"correction": "corrected", "correction_reads": 2, "reuse": False}),
    "kvswap-corrected-overlap-no-reuse": ("kvswap", {"correction": "corrected", "correction_overlap": True, "reuse": False}),
    "kvswap-2-paths-clustered": ("kvswap", {"clustering": True, "recluster_steps": 4}),
    "kvswap-mapped": ("kvswap", {"slot_memory": "mapped"}),
    "kvswap-mapped-corrected-no-reuse": ("kvswap", {"slot_memory": "mapped", "correction": "corrected", "reuse": False}),
    "kvswap-mapped-clustered": ("kvswap", {"slot_memory": "mapped", "clustering": True, "recluster_steps": 4}),
    "token": ("token", {}),
    "flexgen": ("flexgen", {}),
    "hillinfer": ("hillinfer", {"importance_rate": 0.3, "score_block_tokens": 64}),
    "arkv": ("arkv", {"max_kv_mem_mib": 3.0}),
}


@pytest.fixture(autouse=True)
def on_the_gpu(monkeypatch):
    monkeypatch.setenv("EDGEKV_DEVICE", "cuda")  # conftest pins every other test to the CPU


def run(tmp_path, policy, extra, device, dtype=torch.float32, prompts=PROMPTS, context=None):
    paths = [tmp_path / f"{device}-p{i}" for i in range(2 if extra.get("clustering") else 1)]
    for p in paths:
        p.mkdir(parents=True, exist_ok=True)
    with Engine.from_pretrained("fixture", kv_path=paths, config={**BASE, **extra}, policy=policy,
                                device=device, dtype=dtype) as engine:
        if context is not None:
            engine.open_context_store(tmp_path / f"{device}-store", chunk_tokens=64)
            engine.save_context(context, name="doc")
            engine.ttft = TTFTOptions("load_only")
        results = engine.generate(prompts, max_new_tokens=NEW_TOKENS, stop_token_ids=[],
                                  context="doc" if context is not None else None)
        assert str(engine.model.device).startswith(device) and engine.model.dtype == dtype
    return [r.token_ids for r in results]


@pytest.mark.parametrize("case", CASES)
def test_every_policy_on_cuda_gives_the_cpu_tokens_in_fp32(tmp_path, case):
    policy, extra = CASES[case]
    assert run(tmp_path, policy, extra, "cuda") == run(tmp_path, policy, extra, "cpu")


def test_a_hybrid_model_on_cuda_gives_the_cpu_tokens(tmp_path):
    """Gemma 3's windowed layers keep rings; the global layers' picks, launched a layer ahead on the device, are
    taken (and their reads started) while a windowed layer attends."""
    folder = save_model(tmp_path / "gemma3", "gemma3", num_hidden_layers=6, sliding_window=16,
                        layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention",
                                     "full_attention", "full_attention"])
    prompts = [[token % 150 + 4 for token in prompt] for prompt in PROMPTS]  # within its 160 ids
    tokens = {}
    for device in ("cuda", "cpu"):
        (tmp_path / device).mkdir()
        with Engine.from_pretrained(folder, kv_path=tmp_path / device, config=BASE, policy="kvswap",
                                    device=device, dtype=torch.float32) as engine:
            tokens[device] = [r.token_ids for r in engine.generate(prompts, max_new_tokens=NEW_TOKENS,
                                                                   stop_token_ids=[])]
    assert tokens["cuda"] == tokens["cpu"]


def test_a_stored_context_on_cuda_gives_the_cpu_tokens(tmp_path):
    context = [(i * 5) % 250 + 4 for i in range(256)]
    prompts = [[9, 10, 11], [12, 13]]
    assert run(tmp_path, "kvswap", {}, "cuda", prompts=prompts, context=context) == \
        run(tmp_path, "kvswap", {}, "cpu", prompts=prompts, context=context)


def test_the_ttft_plan_on_cuda_gives_full_prefills_tokens(tmp_path):
    """The load-or-compute plan (chunks loaded from the store and recomputed on the GPU, one KV) answers as a full
    prefill does."""
    context = [(i * 3) % 250 + 4 for i in range(384)]
    got = {}
    for method in ("full_prefill", "edgekv"):
        with Engine.from_pretrained("fixture", kv_path=tmp_path, config=BASE, policy="full",
                                    device="cuda", dtype=torch.float32) as engine:
            engine.open_context_store(tmp_path / f"store-{method}", chunk_tokens=64)
            engine.save_context(context, name="doc")
            engine.ttft = TTFTOptions(method, link_mib_s=200.0)
            got[method] = engine.generate([[5, 6, 7]], max_new_tokens=NEW_TOKENS, stop_token_ids=[],
                                          context="doc")[0].token_ids
    assert got["edgekv"] == got["full_prefill"]


def _half_dtypes():
    return [torch.float16] + ([torch.bfloat16] if torch.cuda.is_available()
                              and torch.cuda.is_bf16_supported(including_emulation=False) else [])


@pytest.mark.parametrize("dtype", _half_dtypes(), ids=str)
@pytest.mark.parametrize("policy, extra", [("full", {}), ("kvswap", {"M": 160, "C": 160, "sigma": 1}),
                                           ("flexgen", {})], ids=["full", "kvswap-every-group", "flexgen"])
def test_greedy_tokens_equal_hugging_faces_on_the_gpu_in_half_precision(tmp_path, dtype, policy, extra):
    """The exact policies (every group attended) against transformers' own generate, same GPU, same dtype."""
    from transformers import AutoModelForCausalLM

    from edgekv.runtime.checkpoints import resolve_checkpoint

    prompt = PROMPTS[0][:300]
    hf = AutoModelForCausalLM.from_pretrained(resolve_checkpoint("fixture"), dtype=dtype).to("cuda").eval()
    with torch.inference_mode():
        out = hf.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=NEW_TOKENS, do_sample=False,
                          min_new_tokens=NEW_TOKENS)
    want = out[0, len(prompt):].tolist()
    assert run(tmp_path, policy, extra, "cuda", dtype=dtype, prompts=[prompt]) == [want]


def test_the_default_dtype_is_bf16_only_where_the_gpu_has_it_natively():
    native = torch.cuda.is_bf16_supported(including_emulation=False)
    assert resolve_dtype(torch.device("cuda")) == (torch.bfloat16 if native else torch.float16)
    assert resolve_dtype(torch.device("cuda"), deployed="float16", deployed_device="cuda") == torch.float16
    assert resolve_dtype(torch.device("cpu"), deployed="float16", deployed_device="cuda") == torch.float32
    assert resolve_device(None).type == "cuda"


def test_an_adapter_fitted_on_fewer_keys_than_its_rank_stays_on_the_gpu():
    """adapter.fit padded a CUDA projection with CPU zeros (a prompt shorter than the rank, no adapter file)."""
    keys = torch.randn(3, 64, device="cuda")
    adapter = LowRankAdapter.fit([keys], n_kv_heads=2, head_dim=32, rank=16)
    assert adapter.rank == 16 and adapter.matrices[0].device.type == "cuda"


def test_a_short_prompt_fits_its_adapter_on_the_gpu(tmp_path):
    short = [[5, 6, 7, 8, 9, 10]]  # 6 keys per layer, fewer than the rank: the fitted projection is padded
    assert run(tmp_path, "kvswap", {"sigma": 2}, "cuda", prompts=short) == \
        run(tmp_path, "kvswap", {"sigma": 2}, "cpu", prompts=short)


def test_edgekv_serve_on_cuda_answers_as_the_cpu(tmp_path):
    import httpx

    from tests.serving import poll, post, serving

    body = {"model": "tiny", "prompt": PROMPTS[1][:200], "max_tokens": NEW_TOKENS, "temperature": 0}
    answers = {}
    for device in ("cuda", "cpu"):
        (tmp_path / device).mkdir()
        engine_args = {"kv_path": tmp_path / device, "config": BASE, "device": device, "dtype": torch.float32}
        with serving("fixture", tmp_path / device, store=False,
                     load=lambda: Engine.from_pretrained("fixture", **engine_args)) as (url, state):
            poll(lambda: httpx.get(url + "/health").status_code == 200, "model loaded")
            answer = post(url, "/v1/completions", body)
            assert answer.status_code == 200, answer.text
            answers[device] = answer.json()["choices"][0]["text"]
    assert answers["cuda"] == answers["cpu"]


def _one_batch(tmp_path, extra=None):
    engine = Engine.from_pretrained("fixture", kv_path=tmp_path, config={**BASE, **(extra or {})},
                                    policy="kvswap", device="cuda", dtype=torch.float16)
    batch = engine.open_batch(2, BASE["max_context"])
    for row, prompt in enumerate(PROMPTS):
        batch.join(row, prompt)
    batch.end_prefill()
    return engine, batch


def _host_syncs(engine, batch, steps: int = 3) -> float:
    """Host syncs per decode step as the bench counts them (torch's sync debug mode, after a first warm-up step)."""
    from edgekv.bench import SyncCounter

    with SyncCounter(torch.device("cuda"), steps + 1) as syncs:
        engine.events.subscribe(syncs)
        for _ in range(steps + 1):
            batch.step(torch.tensor([5, 6]))
        torch.cuda.synchronize()
    return syncs.per_step


def test_a_decode_step_syncs_the_host_at_most_once_per_layer(tmp_path):
    """Selection runs on the device; its picks reach the I/O thread in one transfer per layer; every other move
    (indices, lengths, masks, missed records) is a non-blocking copy from pinned memory."""
    engine, batch = _one_batch(tmp_path)
    with batch:
        syncs = _host_syncs(engine, batch)
    engine.close()
    assert syncs <= engine.model.dims.n_layers + 4, syncs


def test_only_missed_records_cross_the_bus(tmp_path):
    engine, batch = _one_batch(tmp_path)
    with batch:
        for _ in range(6):
            batch.step(torch.tensor([5, 6]))
        torch.cuda.synchronize()
        copied, read = batch.policy.slot_memory.bytes_copied, int(batch.policy.bytes_read.sum())
        hits, lookups = batch.policy.reuse_counts()
    engine.close()
    assert hits.sum() > 0 and read > 0  # some picks were hits: they never crossed
    assert copied <= 1.05 * read


def test_mapped_slots_copy_nothing_and_sync_no_more_than_device_slots(tmp_path):
    """slot_memory mapped (a Jetson's layout): the GPU reads the pinned host slots in place, so no record is copied,
    and the step keeps within the same host-sync bound."""
    from edgekv.runtime.slot_memory import MappedSlots

    engine, batch = _one_batch(tmp_path, {"slot_memory": "mapped"})
    with batch:
        assert isinstance(batch.policy.slot_memory, MappedSlots)
        syncs = _host_syncs(engine, batch)
        copied, read = batch.policy.slot_memory.bytes_copied, int(batch.policy.bytes_read.sum())
    engine.close()
    assert read > 0 and copied == 0
    assert syncs <= engine.model.dims.n_layers + 4, syncs


def test_a_device_alias_is_the_pinned_host_memory_itself():
    from edgekv.runtime.slot_memory import device_alias, pinned_aligned

    host = pinned_aligned((4, 4096), 4096)
    alias = device_alias(host.view(-1), torch.device("cuda"))
    assert alias.is_cuda and alias.data_ptr() == host.data_ptr()
    host[1, 7] = 201  # a host write is what the device reads (no copy in between)
    assert int(alias[4096 + 7]) == 201
    alias[5] = 9  # and a device write lands in host memory
    torch.cuda.synchronize()
    assert int(host[0, 5]) == 9
    with pytest.raises(ValueError, match="pinned"):
        device_alias(torch.zeros(16, dtype=torch.uint8), torch.device("cuda"))


def test_decode_attention_runs_without_the_math_kernel():
    from types import SimpleNamespace

    from torch.nn.attention import SDPBackend, sdpa_kernel

    from edgekv.runtime.forward import decode_attention

    model = SimpleNamespace(scaling=0.125)
    q = torch.randn(4, 32, 1, 128, device="cuda", dtype=torch.float16)
    k, v = (torch.randn(4, 8, 4000, 128, device="cuda", dtype=torch.float16) for _ in range(2))
    mask = torch.rand(4, 1, 1, 4000, device="cuda") > 0.5
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
        out = decode_attention(model, q, k, v, mask)
    weights = ((q.view(4, 8, 4, 128).float() @ k.float().transpose(-1, -2)) * 0.125).masked_fill(~mask, float("-inf"))
    want = (weights.softmax(-1) @ v.float()).view(4, 32, 1, 128)
    torch.testing.assert_close(out.float(), want, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_quantized_group_attention_on_the_gpu_equals_the_cpus(fmt):
    """arkv's quantized groups on CUDA: every group dequantized in one call, the CPU's blocks' result."""
    from edgekv.runtime.kernels import resolve_backend
    from edgekv.runtime.qattn import group_kernels
    from tests.test_arkv import quantized_rows

    torch.manual_seed(5)
    layout, rows, _, _ = quantized_rows(fmt, 8, 128, 300)
    q = torch.randn(8, 4, 128)
    cpu_path, gpu_path = group_kernels(resolve_backend("cpu", "torch")), group_kernels(resolve_backend("cuda"))
    cpu = cpu_path.scores(q, rows, layout, 0.09)
    gpu = gpu_path.scores(q.cuda(), rows.cuda(), layout, 0.09)
    torch.testing.assert_close(gpu.cpu(), cpu, rtol=1e-5, atol=1e-4)
    w = cpu.softmax(-1)
    torch.testing.assert_close(gpu_path.values(w.cuda(), rows.cuda(), layout).cpu(),
                               cpu_path.values(w, rows, layout), rtol=1e-5, atol=1e-5)
