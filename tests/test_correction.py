"""Speculate, then correct (issue 33): the layer-ahead guess is rescored with the layer's own query, and the groups
it missed are read before attention.  Uncapped, the corrected picks are the oracle's (the same scores from the same
K_lr at attention time), so the tokens must be the oracle selector's, bit for bit, while the guess's reads still
overlap the layer before."""
import numpy as np
import pytest
import torch

from edgekv.runtime import Engine
from edgekv.runtime.config import ConfigError, RuntimeConfig
from edgekv.runtime.slots import PreloadSlots, SlotTable

# a small M over ~40 groups, so the guess misses some of what the layer's own query wants
BASE = {"G": 4, "M": 6, "C": 12, "sigma": 2, "max_context": 256, "max_batch": 2, "window_tokens": 4}
PROMPTS = [[3 + i % 150 for i in range(157)], [7 + (i * 13) % 150 for i in range(141)]]  # 157 and 141 tokens: not a multiple of G


def _run(model_dir, kv_dir, policy="kvswap", **config):
    kv_dir.mkdir()
    with Engine.from_pretrained(model_dir, kv_offload_path=kv_dir, config={**BASE, **config}, policy=policy,
                                device="cpu") as engine:
        return engine.generate(PROMPTS, max_new_tokens=12, stop_token_ids=[], output_logits=True)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("reuse", [True, False])
def test_uncapped_correction_gives_the_oracles_tokens_and_reads_what_the_guess_missed(model_dirs, tmp_path, arch,
                                                                                      reuse):
    runs = {name: _run(model_dirs[arch], tmp_path / name, reuse=reuse, **extra) for name, extra in {
        "oracle": {"selector": "oracle"}, "corrected": {"correction": "corrected"}, "guess": {}}.items()}
    for oracle, corrected in zip(runs["oracle"], runs["corrected"]):
        assert corrected.token_ids == oracle.token_ids
        assert all(torch.equal(a, b) for a, b in zip(corrected.logits, oracle.logits))
    stats = [r.stats for r in runs["corrected"]]
    assert all(s["kv_correction_records"] > 0 for s in stats)  # the guess did miss some
    assert 0 < stats[0]["guess_recall"] < 1
    assert all(r.stats["kv_correction_records"] == 0 and r.stats["guess_recall"] is None for r in runs["guess"])
    # the correction's reads come on top of the guess's: bytes read count both
    assert all(c.stats["kv_bytes_read"] > 0 for c in runs["corrected"])


def test_a_cap_bounds_the_extra_reads_and_the_guess_fills_in(model_dirs, tmp_path):
    # no reuse buffer: every corrected pick the guess lacks is a read
    capped = _run(model_dirs["llama"], tmp_path / "capped", correction="corrected", correction_reads=1, reuse=False)
    free = _run(model_dirs["llama"], tmp_path / "free", correction="corrected", reuse=False)
    n_layers, steps = 2, 12
    for c, f in zip(capped, free):
        assert 0 < c.stats["kv_correction_records"] <= n_layers * steps  # at most one per layer and step
        assert c.stats["kv_correction_records"] < f.stats["kv_correction_records"]


def test_the_token_policy_corrects_through_its_preload_slots(model_dirs, tmp_path):
    oracle = _run(model_dirs["llama"], tmp_path / "o", policy="token", selector="oracle", M=3)
    corrected = _run(model_dirs["llama"], tmp_path / "c", policy="token", correction="corrected", M=3)
    assert [r.token_ids for r in corrected] == [r.token_ids for r in oracle]
    assert corrected[0].stats["kv_correction_records"] > 0


def test_correction_config_is_checked_by_name_and_counts_its_slots():
    with pytest.raises(ConfigError, match="'correction' must be one of"):
        RuntimeConfig.load({"correction": "always"})
    with pytest.raises(ConfigError, match="'correction_reads' must be a positive integer"):
        RuntimeConfig.load({"correction": "corrected", "correction_reads": 0})
    cfg = RuntimeConfig.load({"M": 10, "G": 4, "window_tokens": 8, "correction": "corrected"})
    assert cfg.correction_slots == 8  # as many as the picks
    assert cfg.with_fields(correction_reads=3).correction_slots == 3
    assert cfg.with_fields(correction="guess").correction_slots == 0


def test_slot_tables_say_what_is_resident_and_place_corrections_without_counting_them():
    table = SlotTable(n_layers=1, batch=2, capacity=3, max_groups=10)
    owners = np.array([[0, 0], [1, 1]])
    table.assign(0, np.array([[1, 2], [4, 5]]), np.ones((2, 2), bool), owners)
    lookups = table.lookups.copy()
    assert table.resident(0, np.array([[2, 3], [5, 1]]), owners).tolist() == [[True, False], [True, False]]
    slots, misses = table.correct(0, np.array([[2, 3], [5, 1]]), np.ones((2, 2), bool), owners)
    assert sorted(zip(misses.seq.tolist(), misses.group.tolist())) == [(0, 3), (1, 1)]
    assert (table.lookups == lookups).all()
    assert table.held(0, 0, np.array([2, 3])).tolist() == slots[0].tolist()

    preload = PreloadSlots(batch=2, capacity=2)  # as many slots as picks: a correction has no slots of its own
    preload.assign(1, np.array([[1, 2], [1, 5]]), np.ones((2, 2), bool), owners)
    slots, misses = preload.correct(1, np.array([[2, 7], [9, 8]]), np.ones((2, 2), bool), owners)
    assert slots[0, 0] == 1  # group 2 where the first look read it
    assert sorted([slots[0, 1], *slots[1]]) == [0, 2, 3]  # 7, 9 and 8 in the slots of the dropped guesses 1, 1, 5
    assert misses.group.tolist() == [7, 9, 8] and misses.slot.tolist() == [slots[0, 1], *slots[1]]
    assert preload.resident(1, np.array([[7, 2], [8, 5]]), owners).tolist() == [[True, True], [True, False]]
