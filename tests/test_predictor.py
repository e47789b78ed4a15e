"""The low-rank predictor: exact at full rank, and it finds the groups that matter."""
import pytest
import torch

from edgekv.runtime import Engine, LowRankAdapter, build_adapter
from edgekv.runtime.adapter import AdapterError
from edgekv.runtime.choices import SELECTOR_NAMES
from edgekv.runtime.config import ConfigError, PredictorConfig, RuntimeConfig
from edgekv.runtime.model import ModelDims
from edgekv.runtime.selector import KLR_BLOCK_TOKENS, SELECTORS, LowRankSelector
from tests.conftest import save_model


def stored_rows(selector, layer, seq, n_tokens):
    """The first ``n_tokens`` K_lr rows of ``seq`` as stored, [stored width, n_tokens]: read by the layout itself
    (token t's stored row i at [layer, seq, t // 64, i, t % 64]), not through the selector's code."""
    blocks = selector.k_lr[layer, seq]
    assert blocks.shape[-1] == KLR_BLOCK_TOKENS == 64
    return torch.stack([blocks[t // 64, :, t % 64] for t in range(n_tokens)], dim=1)


def make_selector(adapter, rank, G=4, picked_groups=2, max_context=64, klr_dtype="float32", score_reduce="sum",
                  scaling=1.0):
    dims = ModelDims(n_layers=1, hidden=64, n_heads=4, n_kv_heads=2, head_dim=16, vocab=10)
    return LowRankSelector(adapter, rank, dims, 1, max_context, G, picked_groups,
                           PredictorConfig(klr_dtype=klr_dtype, score_reduce=score_reduce), torch.device("cpu"), scaling)


def test_full_rank_scores_equal_true_attention_logits_summed_over_heads():
    torch.manual_seed(0)
    k = torch.randn(2, 40, 16)  # [H_kv, T, d]
    q = torch.randn(1, 4, 1, 16)  # 4 query heads over 2 KV heads
    adapter = LowRankAdapter.fit([k.transpose(0, 1).reshape(40, -1)], 2, 16, rank=32)
    selector = make_selector(adapter, 32)
    selector.append(0, 0, 0, k)
    expected = sum(q[0, h, 0] @ k[h // 2].T for h in range(4))
    torch.testing.assert_close(selector.token_scores(0, q, 40)[0], expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("klr_dtype", ["float32", "int8"])
def test_full_rank_softmax_votes_equal_each_heads_attention_summed(klr_dtype):
    torch.manual_seed(3)
    k, q = torch.randn(2, 40, 16), torch.randn(1, 4, 1, 16)
    selector = make_selector(LowRankAdapter.fit([k.transpose(0, 1).reshape(40, -1)], 2, 16, rank=32), 32,
                             klr_dtype=klr_dtype, score_reduce="softmax", scaling=0.25)
    selector.append(0, 0, 0, k)
    expected = sum((q[0, h, 0] @ k[h // 2].T * 0.25).softmax(dim=-1) for h in range(4))
    tolerance = 1e-4 if klr_dtype == "float32" else 0.05  # int8 rows: ~1 % of each logit's range
    torch.testing.assert_close(selector.token_scores(0, q, 40)[0], expected, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("score_reduce", ["sum", "softmax"])
def test_bf16_rows_are_rounded_once_and_scored_in_fp32(score_reduce):
    """A bf16 matmul rounds by device-specific rules (a CPU's and a GPU's picks differed at the top-M boundary):
    the rows are the float32 projection rounded once to bf16, and the scores the float32 product of those rows."""
    torch.manual_seed(4)
    k, q = torch.randn(2, 40, 16), torch.randn(1, 4, 1, 16)
    adapter = LowRankAdapter.fit([k.transpose(0, 1).reshape(40, -1)], 2, 16, rank=8)
    selector = make_selector(adapter, 8, max_context=40, klr_dtype="bfloat16", score_reduce=score_reduce, scaling=0.25)
    selector.append(0, 0, 0, k)
    rows = (k.transpose(0, 1).reshape(40, -1) @ adapter.matrices[0].float()).to(torch.bfloat16)
    assert torch.equal(stored_rows(selector, 0, 0, 40).T, rows)
    basis = adapter.matrices[0].float().view(2, 16, 8)
    per_head = torch.stack([q[0, h, 0] @ basis[h // 2] for h in range(4)])  # [H, r] in float32
    logits = rows.float() @ per_head.T  # [T, H]
    expected = logits.sum(-1) if score_reduce == "sum" else (logits * 0.25).softmax(dim=0).sum(-1)
    torch.testing.assert_close(selector.token_scores(0, q, 40)[0], expected, rtol=1e-5, atol=1e-6)


def test_the_config_takes_the_selectors_there_are_and_no_other():
    """The config checks 'selector' against runtime/choices.py, not the selector module: the names must match."""
    assert tuple(SELECTORS) == SELECTOR_NAMES
    assert [RuntimeConfig.load({"selector": name}).predictor.selector for name in SELECTORS] == list(SELECTORS)
    with pytest.raises(ConfigError, match="selector"):
        RuntimeConfig.load({"selector": "topk"})


def test_grouped_top_m_finds_the_planted_groups():
    torch.manual_seed(1)
    k = torch.randn(2, 64, 16) * 0.1
    q = torch.randn(1, 4, 1, 16)
    for token in (9, 42):  # plant two keys aligned with the query: groups 2 and 10
        k[:, token] = q[0, ::2, 0] * 3
    selector = make_selector(None, 8, G=4, picked_groups=2)
    selector.append(0, 0, 0, k)
    groups, valid = selector.select(0, q, torch.tensor([16]))
    assert sorted(groups[0].tolist()) == [2, 10] and valid.all()


def test_selection_never_returns_groups_not_on_disk():
    selector = make_selector(None, 8, G=4, picked_groups=5)
    selector.append(0, 0, 0, torch.randn(2, 12, 16))
    groups, valid = selector.select(0, torch.randn(1, 4, 1, 16), torch.tensor([3]))
    assert valid.sum() == 3 and sorted(groups[0, valid[0]].tolist()) == [0, 1, 2]


def test_build_adapter_save_load_and_use(model_dirs, kv_path, tmp_path):
    with Engine.from_pretrained(model_dirs["llama"], kv_path=kv_path, config={"max_context": 128},
                                device="cpu") as engine:
        adapter = build_adapter(engine, [list(range(1, 100)), list(range(50, 120))], sigma=4)
    assert adapter.rank == 8 and adapter.sigma == 4
    path = tmp_path / "adapter.safetensors"
    adapter.save(path)
    loaded = LowRankAdapter.load(path)
    assert all(torch.equal(a, b) for a, b in zip(adapter.matrices, loaded.matrices))
    config = {"G": 4, "M": 4, "C": 8, "max_context": 128, "sigma": None, "adapter_path": str(path)}
    with Engine.from_pretrained(model_dirs["llama"], kv_path=kv_path, config=config, device="cpu") as engine:
        assert engine.rank == 8
        assert engine.generate([list(range(1, 60))], max_new_tokens=4, stop_token_ids=[])[0].token_ids
    with pytest.raises(Exception, match="sigma"):
        Engine.from_pretrained(model_dirs["llama"], kv_path=kv_path, config={**config, "sigma": 16},
                               device="cpu")
    deeper = save_model(tmp_path / "deeper", "llama", num_hidden_layers=3)
    with pytest.raises(AdapterError, match="build an adapter for this model"):
        Engine.from_pretrained(deeper, kv_path=kv_path, config=config, device="cpu")




def test_fit_without_an_adapter_file_uses_the_whole_batch_and_is_kept_only_when_it_saw_enough_keys(model_dirs, kv_path,
                                                                                                   caplog):
    config = {"G": 4, "M": 4, "C": 8, "max_context": 128, "sigma": 4}  # rank 8: a fit is kept from 32 keys per layer
    with Engine.from_pretrained(model_dirs["llama"], kv_path=kv_path, config=config, device="cpu") as engine:
        with caplog.at_level("WARNING", logger="edgekv"):
            engine.generate([list(range(1, 8))], max_new_tokens=3, stop_token_ids=[])  # 7 tokens: one group, 4 keys
        assert engine.adapter is None  # not kept for later batches
        assert any("fitted on 4 keys per layer" in r.getMessage() for r in caplog.records)
        caplog.clear()
        with caplog.at_level("WARNING", logger="edgekv"):
            # 2 x 18 tokens: 4 groups each, 32 keys per layer only when both prompts of the batch are fitted on
            engine.generate([list(range(1, 19)), list(range(40, 58))], max_new_tokens=3, stop_token_ids=[])
        assert engine.adapter is not None and engine.adapter.rank == 8
        assert not any("fitted on" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("score_reduce", ["sum", "softmax"])
def test_int8_k_lowrank_scores_track_the_float_ones_at_half_the_bytes(score_reduce):
    torch.manual_seed(2)
    k = torch.randn(2, 64, 16)
    q = torch.randn(1, 4, 1, 16)
    adapter = LowRankAdapter.fit([k.transpose(0, 1).reshape(64, -1)], 2, 16, rank=8)
    exact, int8 = (make_selector(adapter, 8, klr_dtype=t, score_reduce=score_reduce) for t in ("float32", "int8"))
    for selector in (exact, int8):
        selector.append(0, 0, 0, k)
    want, got = exact.token_scores(0, q, 64)[0], int8.token_scores(0, q, 64)[0]
    assert (got - want).abs().max() <= 0.02 * want.abs().max()  # int8 rows with a bf16 scale: ~1 % of the range
    assert int8.resident_bytes == 64 * (8 + 2)  # one byte per element and a 2-byte scale per token
    assert exact.resident_bytes == 64 * 8 * 4


@pytest.mark.parametrize("rank", [8, 7])  # an odd rank leaves the last byte's high nibble empty
def test_int4_k_lowrank_rows_are_the_nibbles_of_the_rounded_projection_at_a_quarter_of_the_bytes(rank):
    torch.manual_seed(5)
    k, q = torch.randn(2, 64, 16), torch.randn(1, 4, 1, 16)
    adapter = LowRankAdapter.fit([k.transpose(0, 1).reshape(64, -1)], 2, 16, rank=rank)
    exact, int4 = (make_selector(adapter, rank, klr_dtype=t) for t in ("float32", "int4"))
    for selector in (exact, int4):
        selector.append(0, 0, 0, k)
    projected = k.transpose(0, 1).reshape(64, -1) @ adapter.matrices[0].float()
    scale = projected.abs().amax(-1) / 7
    levels = (projected / scale[:, None]).round()  # in [-7, 7]
    packed = stored_rows(int4, 0, 0, 64).T
    unpacked = torch.stack([packed & 15, packed >> 4], -1).flatten(-2).float() - 8
    assert torch.equal(unpacked[:, :rank], levels) and (unpacked[:, rank:] == 0).all()
    assert int4.resident_bytes == 64 * ((rank + 1) // 2 + 2)  # half a byte per element and a 2-byte scale per token
    want, got = exact.token_scores(0, q, 64)[0], int4.token_scores(0, q, 64)[0]
    assert (got - want).abs().max() <= 0.15 * want.abs().max()  # 4-bit rows: steps of 1/7 of each row's range
    assert torch.corrcoef(torch.stack([got, want]))[0, 1] > 0.98


@pytest.mark.parametrize("device, native", [("cpu", True), ("cpu", False),
                                            pytest.param("cuda", False, marks=pytest.mark.cuda)])
@pytest.mark.parametrize("shared", ["file", None])
@pytest.mark.parametrize("score_reduce", ["sum", "softmax"])
def test_prompt_adapter_rows_project_through_their_own_prompts_fit(score_reduce, shared, device, native):
    """prompt_adapter: a row whose prompt gives KEYS_PER_RANK x rank keys stores its prompt, the keys a flush appends
    after it and scores its queries through the SVD of its own prompt's keys, as a batch of one fitted on that prompt
    alone would; a shorter prompt's row through the shared adapter (the file's, or fitted on the prompts waiting for
    it), on the native scorer and on torch's path (the torch backend's, and a GPU's)."""
    from edgekv.runtime.kernels import resolve_backend

    backend = resolve_backend(device, None if native else "torch")
    torch.manual_seed(5)
    dims = ModelDims(n_layers=2, hidden=64, n_heads=4, n_kv_heads=2, head_dim=16, vocab=10)
    rank = 8  # a row fits its own from 4 x 8 = 32 keys

    def build(adapter, batch, prompt_adapter):
        return LowRankSelector(adapter, rank, dims, batch, 64, 4, 2, PredictorConfig(
            klr_dtype="float32", score_reduce=score_reduce, prompt_adapter=prompt_adapter), torch.device(device), 0.25,
            backend)

    def fill(selector, rows):
        """The prompts stored, prefill ended, then a decode flush each: every layer's group in one call."""
        for seq, (prompt, _) in enumerate(rows):
            for layer in range(2):
                selector.append(layer, seq, 0, prompt[layer])
        selector.end_prefill()
        for seq, (prompt, tail) in enumerate(rows):
            selector.append_layers(seq, prompt.shape[2], tail)

    prompts = [torch.randn(2, 2, 40, 16, device=device), torch.randn(2, 2, 20, 16, device=device)]  # [L, H_kv, T, d]:
    tails = [torch.randn(2, 2, 4, 16, device=device), torch.randn(2, 2, 4, 16, device=device)]  # 40 keys fit, 20 not
    file = LowRankAdapter([torch.linalg.qr(torch.randn(32, rank))[0] for _ in range(2)], 2, 16)
    batched = build(file if shared else None, 2, True)
    fill(batched, list(zip(prompts, tails)))
    q = torch.randn(2, 4, 1, 16, device=device)
    own = LowRankAdapter.fit([p.transpose(0, 1).reshape(40, -1) for p in prompts[0]], 2, 16, rank)
    for seq, adapter in ((0, own), (1, file if shared else None)):  # None: a batch of one fits on its waiting keys
        alone = build(adapter, 1, False)
        fill(alone, [(prompts[seq], tails[seq])])
        n = prompts[seq].shape[2] + 4
        for layer in range(2):
            assert torch.equal(stored_rows(batched, layer, seq, n), stored_rows(alone, layer, 0, n))
            torch.testing.assert_close(batched.token_scores(layer, q, n)[seq],
                                       alone.token_scores(layer, q[seq : seq + 1], n)[0], rtol=1e-6, atol=1e-6)
    assert batched.resident_bytes == build(file, 2, False).resident_bytes + 2 * 2 * 32 * rank * 4  # [L, B, H_kv*d, r]


def test_a_rows_picks_do_not_depend_on_the_rows_beside_it_even_in_ties():
    """topk breaks ties by the width it sees; the width is every group a sequence can have, not the batch's
    longest, so a request's picks never change with what else is batched (request isolation)."""
    torch.manual_seed(0)
    dims = ModelDims(n_layers=1, hidden=64, n_heads=4, n_kv_heads=2, head_dim=16, vocab=10)
    adapter = LowRankAdapter([torch.zeros(32, 4)], 2, 16)  # every score 0: all ties
    picks = []
    for other_groups in (3, 40):
        sel = LowRankSelector(adapter, 4, dims, 2, 256, 4, 6, PredictorConfig(klr_dtype="float32"),
                              torch.device("cpu"))
        sel.append(0, 0, 0, torch.randn(2, 80, 16))
        sel.append(0, 1, 0, torch.randn(2, other_groups * 4, 16))
        groups, valid = sel.select(0, torch.randn(2, 4, 1, 16), torch.tensor([20, other_groups]))
        picks.append(groups[0][valid[0]].tolist())
    assert picks[0] == picks[1] and len(picks[0]) == 6
