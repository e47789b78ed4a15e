"""arkv: tri-state transitions on scripted attention, the memory budget over a long decode, exactness when
the budget holds everything, and the quantized attention kernel against its torch reference."""
import json
import shutil
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from edgekv.runtime import BudgetError, ConfigError, Engine, RuntimeConfig
from edgekv.runtime.arkv import GROUP_TOKENS, ArkvGeometry, ArkvKV
from edgekv.runtime.checkpoints import resolve_checkpoint
from edgekv.runtime.model import ModelDims
from edgekv.runtime.prompt_cache import PromptKVCache
from edgekv.runtime.kernels import resolve_backend
from edgekv.runtime.qattn import GroupLayout, NativeGroups, TorchGroups, group_kernels
from edgekv.runtime.quant import quant_format, quantize_keys, quantize_values
from tests.conftest import save_model

PROMPTS = [list(range(3, 60)), [7, 9, 11] * 30 + [5], list(range(100, 121))]  # ragged: 57, 91, 21 tokens
CONTEXT = 512


def full_mib(dims: ModelDims, batch: int, context: int = CONTEXT) -> float:
    return batch * dims.n_layers * context * 2 * dims.n_kv_heads * dims.head_dim * 4 / 2**20


def generate(model_dir, policy, config, prompts=PROMPTS, new_tokens=14, on_policy=None, cache=None):
    with Engine.from_pretrained(model_dir, config=config, policy=policy, device="cpu") as engine:
        engine.prompt_cache = cache
        if on_policy is not None:  # see the policy the engine builds, and every decode step
            open_batch = engine.open_batch

            def keep(*args):
                batch = open_batch(*args)
                on_policy["policy"] = batch.policy
                return batch

            engine.open_batch = keep
            engine.events.subscribe(lambda e: e.kind == "decode_step_end" and on_policy["check"](on_policy["policy"]))
        return engine, engine.generate(prompts, max_new_tokens=new_tokens, stop_token_ids=[], output_logits=True)


def dims_of(model_dir) -> ModelDims:
    import json
    from pathlib import Path

    return ModelDims.from_config(json.loads((Path(model_dir) / "config.json").read_text()))


# ---- configuration ----------------------------------------------------------------------------

@pytest.mark.parametrize("field, value", [("arkv_quant", "int3"), ("arkv_gamma", -1.0), ("arkv_window_tokens", 0),
                                          ("arkv_slack", 1.0)])
def test_bad_arkv_field_is_named(field, value):
    with pytest.raises(ConfigError, match=f"'{field}'"):
        RuntimeConfig.load({field: value})


def test_budget_below_the_window_is_refused(model_dirs):
    with pytest.raises(BudgetError, match="arkv_window_tokens"):
        Engine.from_pretrained(model_dirs["llama"], config={"max_context": CONTEXT, "max_batch": 3,
                                                            "max_kv_mem_mib": 0.01}, policy="arkv", device="cpu")


# ---- exactness --------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_arkv_with_the_whole_budget_is_full(model_dirs, arch):
    base = {"max_context": CONTEXT, "max_batch": 3}
    _, reference = generate(model_dirs[arch], "full", base)
    for budget in (None, full_mib(dims_of(model_dirs[arch]), 3)):
        engine, results = generate(model_dirs[arch], "arkv", {**base, "max_kv_mem_mib": budget})
        assert engine.reader is None, "arkv keeps its KV in memory: no disk reader"
        for ref, got in zip(reference, results):
            assert got.token_ids == ref.token_ids
            assert torch.equal(got.logits, ref.logits)


def test_arkv_untailored_matches_full(model_dirs):
    """A budget below the full cache that still holds every token of the run: nothing quantized or evicted."""
    base = {"max_context": CONTEXT, "max_batch": 3}
    _, reference = generate(model_dirs["llama"], "full", base)
    seen = {"check": lambda p: None}
    _, results = generate(model_dirs["llama"], "arkv", {**base, "max_kv_mem_mib": full_mib(dims_of(model_dirs["llama"]), 3) / 2},
                          on_policy=seen)
    policy = seen["policy"]
    assert isinstance(policy, ArkvKV) and policy.tailors.sum() == 0
    for ref, got in zip(reference, results):
        assert got.token_ids == ref.token_ids
        torch.testing.assert_close(got.logits, ref.logits, rtol=0, atol=1e-5)


# ---- the budget -------------------------------------------------------------------------------

@pytest.mark.parametrize("arch, overrides, quant", [
    ("llama", {}, "int8"),
    ("llama", {"num_hidden_layers": 3, "num_key_value_heads": 4, "head_dim": 128}, "int4"),  # odd layers, MHA, d=128
])
def test_budget_holds_over_a_long_decode(tmp_path, monkeypatch, arch, overrides, quant):
    """Prompts without queries (as from a stored context): ρ falls back to FALLBACK_RHO, so the quantized state is used."""
    model_dir = save_model(tmp_path / "m", arch, **overrides)
    dims = dims_of(model_dir)
    budget_mib = full_mib(dims, 2) / 4
    budget_bytes = budget_mib * 2**20
    monkeypatch.setattr(ArkvKV, "prompt_queries", 0)
    seen = {"quantized": 0}

    def check(policy):
        assert policy.resident_bytes <= budget_bytes
        for layer in range(dims.n_layers):
            for seq in range(policy.batch):
                original, quantized = policy.token_states(layer, seq)
                assert len(original) <= policy.slots[layer, seq]
                assert len(quantized) <= policy.groups[layer, seq] * GROUP_TOKENS
                assert policy.used_bytes(layer, seq) <= policy.geo.arena_bytes
                assert len(set(original) & set(quantized)) == 0
                assert set(range(policy.lengths[seq] - policy.window, policy.lengths[seq])) <= set(original)
                seen["quantized"] = max(seen["quantized"], len(quantized))

    seen["check"] = check
    prompts = [list(range(3, 120)), list(range(40, 100))]
    engine, results = generate(model_dir, "arkv", {"max_context": CONTEXT, "max_batch": 2, "max_kv_mem_mib": budget_mib,
                                                   "arkv_quant": quant}, prompts=prompts, new_tokens=300, on_policy=seen)
    policy = seen["policy"]
    assert engine.memory_plan.total_bytes == policy.resident_bytes <= budget_bytes
    assert results[0].stats["kv_resident_bytes"] == policy.resident_bytes
    assert policy.tailors.min() > 1 and seen["quantized"] > 0
    assert all(len(r.token_ids) == 300 for r in results)


def test_prompt_cache_replays_the_queries(model_dirs):
    """An entry kept without queries (by `full`) is computed again for arkv; one kept by arkv replays the same."""
    dims = dims_of(model_dirs["llama"])
    config = {"max_context": CONTEXT, "max_batch": 3, "max_kv_mem_mib": full_mib(dims, 3) / 6}
    _, alone = generate(model_dirs["llama"], "arkv", config)
    cache = PromptKVCache()
    generate(model_dirs["llama"], "full", {"max_context": CONTEXT, "max_batch": 3}, cache=cache)
    for _ in range(2):
        _, cached = generate(model_dirs["llama"], "arkv", config, cache=cache)
        for a, b in zip(alone, cached):
            assert torch.equal(a.logits, b.logits)


# ---- scripted attention: the tailor's three states ------------------------------------------------

def scripted_policy(budget_mib: float, window: int = 4):
    """Two layers, one KV head shared by two query heads, d=16; q = e0 / scaling and k_t = c_t e0 make the
    attention logits exactly the scripted c_t."""
    dims = ModelDims(n_layers=2, hidden=32, n_heads=2, n_kv_heads=1, head_dim=16, vocab=10)
    model = SimpleNamespace(dims=dims, dtype=torch.float32, device=torch.device("cpu"), scaling=0.25)
    cfg = RuntimeConfig.load({"max_context": CONTEXT, "max_batch": 1, "max_kv_mem_mib": budget_mib,
                              "arkv_window_tokens": window})
    return ArkvKV(model, 1, cfg), model


def keys_for(logits: torch.Tensor) -> torch.Tensor:
    k = torch.zeros(1, len(logits), 16)
    k[0, :, 0] = logits
    return k


@pytest.mark.parametrize("budget_mib, evicting", [(0.05, False), (0.03, True)])
def test_tailor_scripted_tri_state(budget_mib, evicting):
    """0.05 MiB holds a quantized copy of every token and some originals; 0.03 MiB does not: the best are
    quantized, the rest evicted, and only the window stays original."""
    torch.manual_seed(0)
    policy, model = scripted_policy(budget_mib=budget_mib)
    T, W = 300, policy.window
    q = torch.zeros(2, T, 16)
    q[:, :, 0] = 1 / model.scaling
    sharp = torch.randperm(T).float() / T * 8  # layer 0: concentrated attention
    flat = torch.randperm(T).float() / T * 2  # layer 1: flatter, a lower OQ score, so more of it quantized
    policy.start_sequence(0)
    for layer, c in enumerate((sharp, flat)):
        policy.observe_prompt(layer, 0, q)
        policy.store_prompt(layer, 0, keys_for(c), torch.randn(1, T, 16))
    policy.end_prompt(0, T)
    rho = policy._rho(0, 2)
    assert rho[0] == 1.0 and rho[1] < 1.0

    keep_o, cap_q = int(policy.keep_original[1, 0]), int(policy.groups[1, 0]) * GROUP_TOKENS
    if evicting:
        assert keep_o == 0 and 0 < cap_q < T - W
    else:
        assert keep_o > 0 and keep_o + cap_q >= T - W and keep_o < T - W
    ranked = (torch.argsort(flat[: T - W], descending=True)).numpy()
    original, quantized = policy.token_states(1, 0)
    np.testing.assert_array_equal(original, np.sort(np.concatenate((ranked[:keep_o], np.arange(T - W, T)))))
    np.testing.assert_array_equal(quantized, np.sort(ranked[keep_o: keep_o + cap_q]))
    assert policy.tailors[1, 0] == 1

    # decode: new tokens with scripted logits; states only go down and the window stays original
    state = {p: 2 for p in range(T)}  # 2 original, 1 quantized, 0 evicted
    for layer_states in [policy.token_states(1, 0)]:
        state.update({int(p): 1 for p in layer_states[1]})
        state.update({p: 0 for p in range(T) if p not in set(layer_states[0]) | set(layer_states[1])})
    qd = torch.zeros(1, 2, 1, 16)
    qd[..., 0] = 1 / model.scaling
    for step in range(200):
        pos = T + step
        for layer in range(2):
            k = torch.zeros(1, 1, 1, 16)
            k[..., 0] = float(torch.rand(1)) * 2
            out = policy.attend(layer, qd, k, torch.randn(1, 1, 1, 16))
            assert torch.isfinite(out).all()
        policy.end_step(np.array([True]))
        original, quantized = policy.token_states(1, 0)
        now = {p: 0 for p in range(pos + 1)} | {int(p): 1 for p in quantized} | {int(p): 2 for p in original}
        assert all(now[p] <= state.get(p, 2) for p in now), "a token went up: quantized -> original or evicted -> kept"
        assert set(range(pos + 1 - W, pos + 1)) <= set(original.tolist())
        state = now
    assert policy.tailors[1, 0] > 2 and policy.resident_bytes <= budget_mib * 2**20


# ---- the kernel ---------------------------------------------------------------------------------

def quantized_rows(fmt: str, n_kv: int, d: int, n_groups: int):
    """(layout, rows uint8 [n_groups, record_bytes], quantized keys, quantized values) of random K/V, every
    position filled in order (no holes)."""
    layout = GroupLayout(n_kv, GROUP_TOKENS, d, quant_format(fmt))
    rows = torch.zeros(n_groups, layout.record_bytes, dtype=torch.uint8)
    f = layout.fields(rows)
    k, v = torch.randn(2, n_groups, n_kv, GROUP_TOKENS, d).unbind(0)
    qk, qv = quantize_keys(k, layout.fmt), quantize_values(v, layout.fmt)
    for name, t in (("k_codes", qk.codes), ("k_scale", qk.scale), ("k_zero", qk.zero),
                    ("v_codes", qv.codes), ("v_scale", qv.scale), ("v_zero", qv.zero)):
        f[name][:] = t
    f["pos"][:] = torch.arange(n_groups * GROUP_TOKENS, dtype=torch.int32).view(n_groups, GROUP_TOKENS)
    return layout, rows, qk, qv


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("n_kv, rep, d, n_groups", [(2, 3, 10, 5), (4, 1, 128, 3), (1, 8, 64, 1)])
def test_kernel_matches_torch(fmt, n_kv, rep, d, n_groups):
    if shutil.which("cc") is None:
        pytest.skip("no C compiler: the torch path serves")
    kernel, torch_path = group_kernels(resolve_backend("cpu", "native")), group_kernels(resolve_backend("cpu", "torch"))
    assert isinstance(kernel, NativeGroups) and type(torch_path) is TorchGroups
    torch.manual_seed(n_kv * 100 + d)
    layout, rows, qk, qv = quantized_rows(fmt, n_kv, d, n_groups)
    pos = layout.fields(rows)["pos"]
    pos[0, 3] = pos[-1, 7:] = -1  # holes
    q = torch.randn(n_kv, rep, d)
    native, reference = kernel.scores(q, rows, layout, 0.3), torch_path.scores(q, rows, layout, 0.3)
    exact = torch.einsum("hjd,nhtd->hjnt", q, qk.dequantize()).flatten(2) * 0.3
    holes = (pos < 0).flatten()
    assert native[..., holes].eq(float("-inf")).all() and reference[..., holes].eq(float("-inf")).all()
    torch.testing.assert_close(native[..., ~holes], reference[..., ~holes], rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(native[..., ~holes], exact[..., ~holes], rtol=1e-5, atol=1e-4)
    w = native.softmax(-1)
    out, ref_out = kernel.values(w, rows, layout), torch_path.values(w, rows, layout)
    exact_out = torch.einsum("hjnt,nhtd->hjd", w.unflatten(-1, (n_groups, GROUP_TOKENS)), qv.dequantize())
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, exact_out, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_the_torch_path_gives_the_same_attention_in_blocks_or_all_groups_at_once(fmt, monkeypatch):
    """A CPU dequantizes 64 groups at a time, a GPU every group in one call: the block is no part of the result."""
    from edgekv.runtime import qattn

    torch.manual_seed(7)
    layout, rows, _, _ = quantized_rows(fmt, 2, 16, 150)
    layout.fields(rows)["pos"][70, 2] = -1  # a hole inside the second block
    q = torch.randn(2, 3, 16)
    results = []
    for block in (64, 1000):
        monkeypatch.setattr(qattn, "TORCH_BLOCK_GROUPS", block)
        scores = TorchGroups().scores(q, rows, layout, 0.3)
        results.append((scores, TorchGroups().values(scores.softmax(-1), rows, layout)))
    (blocked, blocked_out), (whole, whole_out) = results
    assert torch.equal(blocked, whole) and blocked[..., 70 * GROUP_TOKENS + 2].eq(float("-inf")).all()
    torch.testing.assert_close(blocked_out, whole_out, rtol=1e-5, atol=1e-5)  # sums in another order


def test_geometry_quantizes_only_as_the_budget_requires_and_evicts_last():
    """Short: every token original.  Longer: a quantized copy of every token first, then originals up to ρ n
    (fewer as ρ falls).  Longest: tokens evicted, only the window and the slack original."""
    dims = ModelDims(n_layers=4, hidden=64, n_heads=4, n_kv_heads=2, head_dim=16, vocab=10)
    geo = ArkvGeometry(RuntimeConfig.load({"max_context": 8192, "max_batch": 1, "max_kv_mem_mib": 1.0}), dims, 4)
    outside = lambda n: n - geo.window  # noqa: E731
    for n_tokens in (200, 2000, 8192):
        splits = [geo.capacity(rho, n_tokens) for rho in (1.0, 0.5, 0.1)]
        for slots, groups, keep in splits:
            assert slots * geo.original_bytes + groups * geo.layout.record_bytes <= geo.arena_bytes
            assert 0 <= keep < slots - geo.window
        keeps = [keep for _, _, keep in splits]
        held = [keep + groups * GROUP_TOKENS for _, groups, keep in splits]
        if n_tokens == 200:
            assert keeps == [outside(200)] * 3
        elif n_tokens == 2000:
            assert keeps == sorted(keeps)[::-1] and keeps[0] > keeps[-1] > 0
            assert min(held) >= outside(2000), "nothing is evicted while a quantized copy of every token fits"
        else:
            assert keeps == [0, 0, 0] and max(held) < outside(8192)


def test_auto_format_is_int8_while_every_token_fits_it_else_int4():
    dims = ModelDims(n_layers=4, hidden=64, n_heads=4, n_kv_heads=2, head_dim=16, vocab=10)
    full_mib = 4 * 8192 * 2 * 2 * 16 * 4 / 2**20
    bits = {}
    for share in (1 / 2, 1 / 4, 1 / 16):
        cfg = RuntimeConfig.load({"max_context": 8192, "max_batch": 1, "max_kv_mem_mib": full_mib * share})
        geo = ArkvGeometry(cfg, dims, 4)
        bits[share] = geo.layout.fmt.bits
        fixed = ArkvGeometry(RuntimeConfig.load({**cfg.to_dict(), "arkv_quant": "int8"}), dims, 4)
        assert fixed.layout.fmt.bits == 8
    assert bits == {1 / 2: 8, 1 / 4: 4, 1 / 16: 4}
    with pytest.raises(ConfigError, match="'arkv_quant'"):
        RuntimeConfig.load({"arkv_quant": "fp8"})


@pytest.mark.parametrize("quant, budget_share", [("int8", 1 / 4), ("int4", 1 / 5)])
def test_the_batch_in_one_pass_attends_as_one_sequence_at_a_time(monkeypatch, quant, budget_share):
    """A GPU's path (every sequence of a layer in one pass, ragged lengths and group counts padded and masked), run
    here on the CPU: the tokens, logits and every layer's tri-state split of the loop per sequence, through tailors
    that quantize and evict."""
    prompts = [list(range(3, 150)), [7, 9, 11] * 30 + [5], list(range(100, 121))]
    dims = ModelDims.from_config(json.loads((resolve_checkpoint("fixture") / "config.json").read_text()))
    config = {"max_context": CONTEXT, "max_batch": 3, "arkv_quant": quant,
              "max_kv_mem_mib": full_mib(dims, 3) * budget_share}
    runs, init = {}, ArkvKV.__init__
    for batched in (False, True):
        def init_as(self, *args, batched=batched, **kwargs):
            init(self, *args, **kwargs)
            self.batched = batched

        monkeypatch.setattr(ArkvKV, "__init__", init_as)
        seen = {"check": lambda policy: None}
        _, results = generate("fixture", "arkv", config, prompts=prompts, new_tokens=120, on_policy=seen)
        policy = seen["policy"]
        states = [policy.token_states(layer, seq) for layer in range(dims.n_layers) for seq in range(3)]
        runs[batched] = results, states, policy.tailors.copy()
    (loop, loop_states, loop_tailors), (batch, batch_states, batch_tailors) = runs[False], runs[True]
    assert loop_tailors.min() > 0 and any(len(quantized) for _, quantized in loop_states)
    assert [r.token_ids for r in batch] == [r.token_ids for r in loop]
    for a, b in zip(batch, loop):
        torch.testing.assert_close(a.logits, b.logits, rtol=1e-4, atol=1e-4)
    assert np.array_equal(batch_tailors, loop_tailors)
    for (o1, q1), (o2, q2) in zip(batch_states, loop_states):
        assert np.array_equal(o1, o2) and np.array_equal(q1, q2)
