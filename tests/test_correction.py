"""Speculate, then correct: the layer-ahead guess is rescored with the layer's own query, and the groups
it missed are read before attention.  Uncapped, the corrected picks are the oracle's (the same scores from the same
K_lr at attention time), so the tokens must be the oracle selector's, bit for bit, while the guess's reads still
overlap the layer before."""
import threading

import numpy as np
import pytest
import torch

from edgekv.runtime import Engine, forward, guesses
from edgekv.runtime.offload import correction, io
from edgekv.runtime.config import ConfigError, RuntimeConfig
from edgekv.runtime.slots import PreloadSlots, SlotTable

# a small M over ~40 groups, so the guess misses some of what the layer's own query wants
BASE = {"G": 4, "M": 6, "C": 12, "sigma": 2, "max_context": 256, "max_batch": 2, "window_tokens": 4}
PROMPTS = [[3 + i % 150 for i in range(157)], [7 + (i * 13) % 150 for i in range(141)]]  # 157 and 141 tokens: not a multiple of G


def _run(model_dir, kv_path, policy="kvswap", **config):
    kv_path.mkdir()
    with Engine.from_pretrained(model_dir, kv_path=kv_path, config={**BASE, **config}, policy=policy,
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


@pytest.mark.parametrize("reuse", [True, False])
def test_guesses_from_the_step_before_keep_the_uncapped_correction_the_oracles(model_dirs, tmp_path, monkeypatch,
                                                                                reuse):
    """``guess_from_before``: where a layer's own picks of the step before held more than the layer-ahead prediction,
    they are its next guess (nothing scored a layer ahead); the guess moves reads only, so the tokens stay the
    oracle's bit for bit.  (The oracle predicts nothing: the poor prediction touches the corrected run only.)"""
    from edgekv.runtime.model import DecoderModel
    query = DecoderModel.query  # the layer-ahead prediction made poor (the lowest scores): the step before wins
    monkeypatch.setattr(DecoderModel, "query", lambda self, layer, x, rope: -query(self, layer, x, rope))
    guessed_before = []
    before = guesses.GuessSources.before
    monkeypatch.setattr(guesses.GuessSources, "before", lambda self, layer: guessed_before.append(
        before(self, layer) is not None) or before(self, layer))
    oracle = _run(model_dirs["llama"], tmp_path / "oracle", reuse=reuse, selector="oracle")
    corrected = _run(model_dirs["llama"], tmp_path / "before", reuse=reuse, correction="corrected",
                     guess_from_before=True)
    for o, c in zip(oracle, corrected):
        assert c.token_ids == o.token_ids
        assert all(torch.equal(a, b) for a, b in zip(c.logits, o.logits))
    assert any(guessed_before) and not all(guessed_before)  # some layer-steps guessed from the step before


def test_a_layer_guesses_from_the_step_before_while_that_holds_more_than_the_prediction_did():
    """``GuessSources``: a layer corrected at two steps in a row takes its picks of the step before as its guess when
    they held more of the corrected picks than the prediction; back to predicting once they hold less than the
    prediction last did, or when the layer will not correct at the next step (the picks would go stale)."""
    sources = guesses.GuessSources(n_layers=1)
    valid = np.ones((1, 4), dtype=bool)

    def correct(step, picks, guess, corrects_next=True):
        groups = np.array([picks])
        sources.corrected(0, step, groups, valid, valid & guesses.in_rows(groups, np.array([guess])), corrects_next)
        before = sources.before(0)
        return None if before is None else before[1][before[0]]

    assert correct(0, [1, 2, 3, 4], [1, 9, 9, 9]) is None  # nothing from the step before yet
    assert correct(1, [1, 2, 3, 5], [1, 9, 9, 9]).tolist() == [[1, 2, 3, 5]]  # 3 of 4 held against 1 of 4
    assert correct(2, [1, 2, 6, 7], [1, 2, 3, 5]).tolist() == [[1, 2, 6, 7]]  # 2 of 4 still beat the prediction's 1
    assert correct(3, [8, 9, 10, 11], [1, 2, 6, 7]) is None  # none held: predict again
    assert correct(4, [8, 9, 10, 12], [8, 9, 10, 12]) is None  # the prediction holds up
    assert correct(5, [8, 9, 10, 13], [8, 0, 0, 0], corrects_next=False) is None  # uncorrected next: stale picks
    sources.reset()
    assert sources.before(0) is None


def test_each_row_guesses_and_is_probed_on_its_own_picks():
    """Rows decide apart: where one row's guess slips and the other's holds, only the first keeps correcting (or
    switches to its picks of the step before); a row that starts again starts its own schedule alone.  A decision
    over the batch's sums made a request's picks depend on the rows beside it."""
    schedule = guesses.ProbeSchedule(n_layers=1, batch=2)
    schedule.measured(0, 0, held=np.array([True, False]))
    assert schedule.due(0, 1).tolist() == [False, True]
    schedule.reset(1)
    assert schedule.due(0, 1).tolist() == [False, True] and not schedule.due(0, 7)[0] and schedule.due(0, 8)[0]
    schedule.reset(0)
    assert schedule.due(0, 1).tolist() == [True, True]

    sources = guesses.GuessSources(n_layers=1, batch=2)
    valid = np.ones((2, 4), dtype=bool)
    picks = np.array([[1, 2, 3, 4], [5, 6, 7, 8]])
    guessed = np.array([[True, False, False, False], [True, True, True, True]])  # row 0's prediction was poor
    sources.corrected(0, 0, picks, valid, guessed, corrects_next=True)
    sources.corrected(0, 1, picks, valid, guessed, corrects_next=True)
    rows, before = sources.before(0)
    assert rows.tolist() == [True, False] and before[0].tolist() == [1, 2, 3, 4]
    sources.corrected(0, 2, picks, valid, guessed, corrects_next=True, rows=np.array([False, True]))  # row 1 alone
    assert sources.before(0)[0].tolist() == [True, False]
    sources.reset(0)
    assert sources.before(0) is None


def test_a_cap_bounds_the_extra_reads_and_the_guess_fills_in(model_dirs, tmp_path):
    # no reuse buffer: every corrected pick the guess lacks is a read
    capped = _run(model_dirs["llama"], tmp_path / "capped", correction="corrected", correction_reads=1, reuse=False)
    free = _run(model_dirs["llama"], tmp_path / "free", correction="corrected", reuse=False)
    n_layers, steps = 2, 12
    for c, f in zip(capped, free):
        assert 0 < c.stats["kv_correction_records"] <= n_layers * steps  # at most one per layer and step
        assert c.stats["kv_correction_records"] < f.stats["kv_correction_records"]


@pytest.mark.parametrize("reuse", [True, False])
def test_the_next_layers_read_starts_once_the_correction_lands_before_this_layer_attends(model_dirs, tmp_path,
                                                                                        monkeypatch, reuse):
    """A correcting layer's reads go first and the next layer's read waits for them, but no longer: it starts as
    they land (or at once when the correction reads nothing), while this layer still attends.  Each attention of a
    layer holding up the next one's read waits here until that read has started; had the read waited for the
    attention, it would time out.  No helper thread: a layer's picks are then taken before the layer before attends
    (a helper's posted picks may come after it, once the correction has landed and there is nothing to wait for)."""
    from edgekv.runtime import aside
    monkeypatch.setattr(aside, "cores", lambda: 1)
    started: dict[int, threading.Event] = {}  # layer -> set once its read is past its gate
    read, correct = io.ReadIO.read, correction.Correction._correct
    waits = []

    def gated_read(self, layer, buffer, misses, reads, after=None):
        if after is not None:
            after.wait(timeout=30)
            started.setdefault(layer, threading.Event()).set()
        return read(self, layer, buffer, misses, reads, after)

    def attention_after_next_read(self, layer, *args):
        out = correct(self, layer, *args)  # corrected; the layer attends next
        if layer in self._gates:  # the next layer's read waits for this one's correction
            waits.append(started.setdefault(layer + 1, threading.Event()).wait(timeout=10))
            started.pop(layer + 1)
        return out

    monkeypatch.setattr(io.ReadIO, "read", gated_read)
    monkeypatch.setattr(correction.Correction, "_correct", attention_after_next_read)
    runs = _run(model_dirs["llama"], tmp_path / "kv", correction="corrected", reuse=reuse)
    assert all(r.stats["kv_correction_records"] > 0 for r in runs)
    assert len(waits) == 11 and all(waits)  # each decode step's layer 0 held up layer 1's read, and let it go first


def test_the_token_policy_corrects_through_its_preload_slots(model_dirs, tmp_path):
    oracle = _run(model_dirs["llama"], tmp_path / "o", policy="token", selector="oracle", M=3)
    corrected = _run(model_dirs["llama"], tmp_path / "c", policy="token", correction="corrected", M=3)
    assert [r.token_ids for r in corrected] == [r.token_ids for r in oracle]
    assert corrected[0].stats["kv_correction_records"] > 0


@pytest.mark.parametrize("policy, extra", [("kvswap", {"reuse": True}), ("kvswap", {"reuse": False}),
                                           ("kvswap", {"reuse": False, "correction_reads": 1}), ("token", {"M": 3})])
def test_overlapped_correction_attends_the_same_picks_merged_by_log_sum_exp(model_dirs, tmp_path, monkeypatch, policy,
                                                                           extra):
    # the picks in memory attended while the correction's reads land, then those: the same attention up to rounding
    merges = []
    monkeypatch.setattr(correction, "merge_attention", lambda parts, dtype: merges.append(len(parts)) or
                        forward.merge_attention(parts, dtype))
    runs = {overlap: _run(model_dirs["llama"], tmp_path / str(overlap), policy=policy, correction="corrected",
                          correction_overlap=overlap, **extra) for overlap in (False, True)}
    for joined, split in zip(runs[False], runs[True]):
        assert split.token_ids == joined.token_ids
        assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-4) for a, b in zip(split.logits, joined.logits))
        assert split.stats["kv_correction_records"] == joined.stats["kv_correction_records"] > 0
    assert merges and set(merges) == {2}  # the steps that read corrected picks attended them apart


def test_attention_parts_merge_into_the_whole_and_an_empty_part_weighs_nothing(model_dirs):
    from edgekv.runtime.model import load_model
    model = load_model(model_dirs["llama"], torch.device("cpu"), torch.float32, 64)
    b, h_kv, d = 2, model.dims.n_kv_heads, model.dims.head_dim
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(b, model.dims.n_heads, 1, d, generator=gen)
    k, v = torch.randn(b, h_kv, 20, d, generator=gen), torch.randn(b, h_kv, 20, d, generator=gen)
    mask = torch.rand(b, 1, 1, 20, generator=gen) > 0.3
    mask[..., 0] = True
    first = torch.zeros_like(mask)
    first[..., :12] = True
    second = mask & ~first
    second[1] = False  # row 1: everything in the first part
    parts = [forward.decode_attention_part(model, q, k, v, mask & first),
             forward.decode_attention_part(model, q, k, v, second)]
    assert torch.isneginf(parts[1][1][1]).all() and (parts[1][0][1] == 0).all()
    whole = forward.decode_attention(model, q, k, v, mask & (first | second))
    assert torch.allclose(forward.merge_attention(parts, q.dtype), whole, atol=1e-5)


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


def test_guess_recall_finds_each_rows_own_guesses_only():
    """``in_rows`` (the recall the stats report): a group counts where the same row guessed it; -1 pads a row."""
    groups = np.array([[3, 7, 9], [3, 4, 5]])
    guess = np.array([[9, 1, -1], [-1, 4, 3]])
    assert guesses.in_rows(groups, guess).tolist() == [[False, False, True], [True, True, False]]
    assert not guesses.in_rows(groups, np.full((2, 2), -1)).any()


def test_a_layer_whose_guess_holds_up_goes_uncorrected_between_probes(model_dirs, tmp_path):
    """``correction_recall``: a layer whose guess had at least that share of its corrected picks skips the correction
    for PROBE_STEPS steps (the first probe's skip), then is corrected (and measured) again; at 1 every layer corrects
    every step."""
    every = _run(model_dirs["llama"], tmp_path / "every", correction="corrected", reuse=False)
    lenient = _run(model_dirs["llama"], tmp_path / "lenient", correction="corrected", reuse=False,
                   correction_recall=1e-6)
    strict = _run(model_dirs["llama"], tmp_path / "strict", correction="corrected", reuse=False, correction_recall=0.999)
    assert every[0].stats["corrected_layer_share"] == 1.0
    decode_steps = 11  # 12 new tokens, the first from the prompt's forward: a lenient layer corrects at steps 0 and 8
    assert 0 < lenient[0].stats["corrected_layer_share"] <= 2 / decode_steps
    assert lenient[0].stats["kv_correction_records"] < every[0].stats["kv_correction_records"]
    # a guess short of 0.999 of the corrected picks at every step (recall < 1 above) keeps its layer corrected
    assert strict[0].stats["corrected_layer_share"] > lenient[0].stats["corrected_layer_share"]
    guess = _run(model_dirs["llama"], tmp_path / "guess")
    assert guess[0].stats["corrected_layer_share"] is None


def test_a_layer_that_keeps_passing_its_probes_is_probed_ever_more_rarely():
    """``ProbeSchedule``: a passed probe skips PROBE_STEPS steps, doubling while the probes pass (up to
    PROBE_STEPS_MAX); a failed one corrects every step until a probe passes, then the skip starts short again."""
    schedule = guesses.ProbeSchedule(n_layers=2)

    def corrected_steps(layer, steps, held=lambda step: True):
        out = []
        for step in steps:
            if schedule.due(layer, step):
                out.append(step)
                schedule.measured(layer, step, held(step))
        return out

    probes = corrected_steps(0, range(400))
    gaps = np.diff(probes).tolist()
    assert gaps[:4] == [guesses.PROBE_STEPS * 2 ** i for i in range(4)]
    assert max(gaps) == guesses.PROBE_STEPS_MAX and gaps[-1] == guesses.PROBE_STEPS_MAX
    assert schedule.due(1, 0) and not schedule.due(0, probes[-1] + 1)  # layers are scheduled apart
    slipping = corrected_steps(0, range(400, 471), held=lambda step: step >= 470)  # the guess slips, then holds
    assert slipping[0] == probes[-1] + guesses.PROBE_STEPS_MAX  # noticed at the next probe ...
    assert slipping[1:] == list(range(slipping[0] + 1, 471))  # ... then corrected every step until it holds
    assert corrected_steps(0, range(471, 500)) == [470 + guesses.PROBE_STEPS, 470 + 3 * guesses.PROBE_STEPS]  # and skipped briefly again
    schedule.reset()
    assert schedule.due(0, 0) and corrected_steps(0, range(9)) == [0, 8]


def test_correction_recall_is_a_share():
    for bad in (0, 1.5, "high"):
        with pytest.raises(ConfigError, match="'correction_recall' must be in \\(0, 1\\]"):
            RuntimeConfig.load({"correction": "corrected", "correction_recall": bad})


def _helper_builds() -> bool:
    from edgekv.runtime.kernels import resolve_backend
    return resolve_backend("cpu").name == "native"


@pytest.mark.skipif(not _helper_builds(), reason="no C compiler for the native scorer and the helper thread")
@pytest.mark.parametrize("config", [{"correction": "corrected", "reuse": True, "klr_dtype": "int4"},
                                    {"reuse": False, "guess_from_before": True, "correction": "corrected"}])
def test_a_helper_thread_changes_neither_tokens_nor_reads(model_dirs, tmp_path, monkeypatch, config):
    """On a CPU with a second core a helper thread makes the layer-ahead scores while the layer before attends (they
    are taken after that attention), or shares them and each correction's: the same tokens, logits, reads and
    reuse as with no helper."""
    from edgekv.runtime import aside, selector as selector_module
    scored_aside = []
    host = selector_module.ScoredAside.host  # where the policy takes the picks the helper made
    monkeypatch.setattr(selector_module.ScoredAside, "host", lambda self: scored_aside.append(1) or host(self))
    runs = {}
    for cores in (2, 1):
        monkeypatch.setattr(aside, "cores", lambda: cores)
        runs[cores] = _run(model_dirs["llama"], tmp_path / f"cores{cores}", **config)
        assert bool(scored_aside) == (cores == 2)
        scored_aside.clear()
    for helped, in_line in zip(runs[2], runs[1]):
        assert helped.token_ids == in_line.token_ids
        assert all(torch.equal(a, b) for a, b in zip(helped.logits, in_line.logits))
        for key in ("kv_bytes_read", "reuse_hits", "kv_correction_records", "kv_records_read"):
            assert helped.stats[key] == in_line.stats[key], key
