"""Predicted chunk costs of the TTFT planner: the compute predictor's fit, the roofline, load times, the profiler."""
import json

import numpy as np
import pytest
import torch

from edgekv.install import chunk_profile as cp
from edgekv.runtime.ttft.costs import (
    FEATURES_LAYER, ComputeCostModel, RooflineCostModel, chunk_lengths, cost_model_from_json, layer0_features,
    layer_features, load_s,
)
from edgekv.runtime.ttft.grid import ChunkGrid

TRUE0 = (2e-4, 1e-5)  # seconds per call, per token
TRUE = (1e-3, 5e-5, 2e-8, 1e-7)  # per call, token, query-key pair, key


def _roofline(**over) -> RooflineCostModel:
    dims = dict(hidden=128, n_heads=4, n_kv_heads=2, head_dim=32, intermediate=384, layer_params=4 * 128 * 128 + 3 * 128 * 384,
                qkv_params=2 * 128 * 128, elem_bytes=4, peak_flops=1e11, bandwidth=1e10)
    return RooflineCostModel.from_dims(**{**dims, **over})


def _synthetic_profile(noise: float = 0.0) -> cp.ChunkProfile:
    rng = np.random.default_rng(0)
    points = cp.sample_points((256, 512, 1024), (1024, 2048, 4096, 8192))
    profile = cp.ChunkProfile({"model": "synthetic"}, 4, roofline=_roofline().to_json())
    for i, (n, p) in enumerate(points):
        jitter = 1 + noise * rng.standard_normal(2)
        profile.layer0_s.append([n, p, float(layer0_features(n) @ TRUE0) * jitter[0], cp._held_out(i)])
        profile.layer_s.append([n, p, float(layer_features(n, p) @ TRUE) * jitter[1], cp._held_out(i)])
    return profile


# ---- the fit ----------------------------------------------------------------------------------

def test_fit_recovers_known_coefficients():
    n = np.array([256, 256, 512, 512, 1024, 1024, 768])
    p = np.array([0, 4096, 1024, 7000, 0, 3000, 512])
    coeffs = cp.fit_coeffs(layer_features(n, p), layer_features(n, p) @ TRUE)
    np.testing.assert_allclose(coeffs, TRUE, rtol=1e-6)
    np.testing.assert_allclose(cp.fit_coeffs(layer0_features(n), layer0_features(n) @ TRUE0), TRUE0, rtol=1e-6)


def test_fit_is_non_negative_and_refuses_bad_timings():
    n = np.array([256, 512, 1024, 2048])
    seconds = 1e-3 - 1e-7 * n  # falls with n: the unconstrained slope would be negative
    assert (cp.fit_coeffs(layer0_features(n), seconds) >= 0).all()
    with pytest.raises(ValueError, match="positive"):
        cp.fit_coeffs(layer0_features(n), np.array([1.0, 0.0, 1.0, 1.0]))


def test_fit_report_on_exact_synthetic_timings():
    profile = _synthetic_profile()
    report = cp.fit_report(profile)
    model = ComputeCostModel.from_json(report["predictor"])
    np.testing.assert_allclose(model.coeffs_layer, TRUE, rtol=1e-5)
    np.testing.assert_allclose(model.coeffs_layer0, TRUE0, rtol=1e-5)
    for kind in ("layer", "layer0"):
        for split in ("fit", "held_out"):
            e = report["errors"][kind][split]
            assert e["predictor"]["mape"] < 1e-3 and e["predictor"]["n"] > 0
            assert e["roofline"]["mape"] >= 0 and e["roofline"]["max_ape"] >= e["roofline"]["mape"]
    held = sum(r[3] for r in profile.layer_s)
    assert report["errors"]["layer"]["held_out"]["predictor"]["n"] == held
    assert report["errors"]["layer"]["fit"]["predictor"]["n"] == len(profile.layer_s) - held
    assert "predictor" in cp.format_report(profile, report) and json.dumps(report)


def test_held_out_samples_do_not_move_the_fit():
    profile = _synthetic_profile(noise=0.02)
    before = cp.fit_predictor(profile)
    for row in profile.layer_s:
        if row[3]:
            row[2] *= 10  # held-out timings are wildly off: the fit must not see them
    assert cp.fit_predictor(profile) == before
    assert cp.fit_report(profile)["errors"]["layer"]["held_out"]["predictor"]["mape"] > 80  # |1 - 10| / 10


def test_sample_points_cover_starts_and_context_ends():
    points = cp.sample_points((256, 1024), (1024, 2048))
    assert points == [(256, 0), (256, 768), (256, 1792), (1024, 0), (1024, 1024)]
    assert max(p + n for n, p in points) == 2048


# ---- compute_s ----------------------------------------------------------------------------------

def test_compute_s_shape_and_order():
    model = cp.fit_predictor(_synthetic_profile())
    grid = ChunkGrid(4096, 512, 6)
    cost = model.compute_s(grid)
    assert cost.shape == grid.shape == (8, 6)
    assert (cost > 0).all() and np.isfinite(cost).all()
    assert (cost[:, 0] < cost[:, 1]).all()  # embedding + q/k/v only vs a whole layer
    assert (np.diff(cost[:, 1]) > 0).all()  # later chunks attend over more keys
    np.testing.assert_allclose(cost[:, 1:], cost[:, [1]].repeat(5, axis=1))  # layers >= 1 have the same shapes
    n, p = 512, 3 * 512
    assert cost[3, 2] == pytest.approx(float(layer_features(n, p) @ TRUE))
    assert cost[3, 0] == pytest.approx(float(layer0_features(n) @ TRUE0))


def test_compute_s_partial_last_chunk():
    model = ComputeCostModel(TRUE0, TRUE)
    grid = ChunkGrid(1000, 256, 2)
    assert list(chunk_lengths(grid)) == [256, 256, 256, 232]
    cost = model.compute_s(grid)
    assert cost[3, 1] == pytest.approx(float(layer_features(232, 768) @ TRUE))
    assert cost[3, 0] == pytest.approx(float(layer0_features(232) @ TRUE0))
    assert model.chunk_s(232, 768) == pytest.approx(cost[3, 1])
    assert model.chunk_s(232, 768, layer0=True) == pytest.approx(cost[3, 0])


def test_scale_rescales_every_cost():
    grid = ChunkGrid(3000, 512, 3)
    for model in (ComputeCostModel(TRUE0, TRUE), _roofline()):
        np.testing.assert_allclose(model.scale(1.5).compute_s(grid), 1.5 * model.compute_s(grid))
        with pytest.raises(ValueError):
            model.scale(0)


def test_roofline_counts():
    roof = _roofline()
    n, p, hd = 256, 1024, 4 * 32
    flops = 2 * n * (4 * 128 * 128 + 3 * 128 * 384) + 4 * n * (p + n) * hd
    assert float(layer_features(n, p) @ np.array(roof.flops_layer)) == pytest.approx(flops)
    weights = 4 * (4 * 128 * 128 + 3 * 128 * 384)
    kv = 2 * (p + n) * 2 * 32 * 4
    assert float(layer_features(n, p) @ np.array(roof.bytes_layer)) > weights + kv
    grid = ChunkGrid(2048, 256, 3)
    cost = roof.compute_s(grid)
    assert cost.shape == (8, 3) and (cost[:, 0] < cost[:, 1]).all() and (np.diff(cost[:, 1]) > 0).all()
    # memory-bound when the device computes fast enough, compute-bound when it moves bytes fast enough
    fast_compute = _roofline(peak_flops=1e18)
    np.testing.assert_allclose(fast_compute.chunk_s(n, p), float(layer_features(n, p) @ np.array(roof.bytes_layer)) / 1e10)
    assert _roofline(bandwidth=1e18).chunk_s(n, p) == pytest.approx(flops / 1e11)


# ---- JSON ---------------------------------------------------------------------------------------

def test_json_round_trips():
    fit = ComputeCostModel(TRUE0, TRUE)
    roof = _roofline()
    for model in (fit, roof):
        data = json.loads(json.dumps(model.to_json()))
        assert cost_model_from_json(data) == model and type(model).from_json(data) == model
    assert fit.to_json()["features_layer"] == list(FEATURES_LAYER)
    profile = _synthetic_profile()
    assert cp.ChunkProfile.from_json(json.loads(json.dumps(profile.to_json()))) == profile
    stale = {**fit.to_json(), "features_layer": ["call", "tokens", "pairs"]}
    with pytest.raises(ValueError, match="profile the chunks again"):
        ComputeCostModel.from_json(stale)
    with pytest.raises(ValueError, match="coefficients"):
        ComputeCostModel(TRUE0, TRUE[:3])


# ---- load_s -------------------------------------------------------------------------------------

def test_load_s_scales_with_bytes_and_rate():
    grid = ChunkGrid(1000, 256, 4)
    base = load_s(grid, 2**20, 100.0)
    assert base.shape == grid.shape and np.allclose(base, 0.01)
    np.testing.assert_allclose(load_s(grid, 2 * 2**20, 100.0), 2 * base)
    np.testing.assert_allclose(load_s(grid, 2**20, 200.0), base / 2)
    np.testing.assert_allclose(load_s(grid, 2**20, 100.0, latency_s=0.002), base + 0.002)
    per_chunk = chunk_lengths(grid) * 4096  # the partial last chunk has fewer bytes
    cost = load_s(grid, per_chunk, 50.0)
    assert cost[3, 0] < cost[2, 0] and (cost[:, 1:] == cost[:, [0]]).all()
    assert cost[0, 2] == pytest.approx(256 * 4096 / (50 * 2**20))
    full = np.arange(16, dtype=float).reshape(4, 4) * 2**20
    np.testing.assert_allclose(load_s(grid, full, 1.0), np.arange(16).reshape(4, 4))


def test_load_s_refuses_wrong_shapes_and_rates():
    grid = ChunkGrid(1000, 256, 4)
    with pytest.raises(ValueError, match="4 token chunks"):
        load_s(grid, np.ones(3), 100.0)
    with pytest.raises(ValueError, match="shape"):
        load_s(grid, np.ones((4, 3)), 100.0)
    with pytest.raises(ValueError, match="positive"):
        load_s(grid, 1, 0.0)


# ---- a real profile (tiny) -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def fixture_model():
    from edgekv.runtime.checkpoints import resolve_checkpoint
    from edgekv.runtime.model import load_model

    return load_model(resolve_checkpoint("fixture"), torch.device("cpu"), torch.float32, 256)


def test_time_chunk_walks_up_the_layers(fixture_model):
    from edgekv.runtime.ttft.compute import ChunkCompute, PrefixKV

    kv = PrefixKV(fixture_model, 64)
    compute = ChunkCompute(fixture_model, list(range(64)), kv)
    first, rest = cp.time_chunk(compute, (32, 64), repeats=5)  # 5 > 3 layers above 0: wraps around
    assert len(first) == len(rest) == 5 and min(first + rest) > 0
    assert not compute._state  # the span is dropped after timing
    assert kv.kv[:, :, :, 32:64].abs().sum(dim=(1, 2, 3, 4)).gt(0).all()  # every layer's K/V of the span was written


def test_tiny_real_profile(fixture_model):
    ticks = []
    profile = cp.profile_chunks(fixture_model, (16, 32), (64, 128), repeats=1, sweeps=2, progress=lambda: ticks.append(1),
                                fingerprint={"model": "fixture"})
    points = cp.sample_points((16, 32), (64, 128))
    assert len(ticks) == cp.n_chunk_steps((16, 32), (64, 128), 2) == 2 * len(points) + 1
    assert [r[:2] for r in profile.layer_s] == [list(x) for x in points] and profile.n_layers == 4
    assert all(r[2] > 0 for r in profile.layer_s + profile.layer0_s)
    assert 0 < sum(r[3] for r in profile.layer_s) < len(points)
    roof = RooflineCostModel.from_json(profile.roofline)
    assert roof.peak_flops > 0 and roof.bandwidth > 0
    report = cp.fit_report(profile)
    model = ComputeCostModel.from_json(report["predictor"])
    coeffs = np.array(model.coeffs_layer0 + model.coeffs_layer)
    assert np.isfinite(coeffs).all() and (coeffs >= 0).all()  # tiny chunks: the overhead may explain all of it
    assert max(model.coeffs_layer0) > 0 and max(model.coeffs_layer) > 0
    assert (model.compute_s(ChunkGrid(128, 32, 4)) > 0).all()
    for kind in ("layer", "layer0"):
        for name in ("predictor", "roofline"):
            e = report["errors"][kind]["held_out"][name]
            assert e["n"] > 0 and np.isfinite(e["mape"]) and e["max_ape"] >= e["mape"] >= 0
    text = cp.format_report(profile, report)
    assert "held-out" in text and "roofline" in text


def test_cli_writes_profile_coefficients_and_errors(tmp_path, capsys):
    out = tmp_path / "chunks.json"
    assert cp.main(["--model", "fixture", "--json", str(out), "--chunks", "16", "--contexts", "48,64",
                    "--repeats", "1", "--sweeps", "1", "--quiet"]) == 0
    data = json.loads(out.read_text())
    assert {"fingerprint", "profile", "predictor", "roofline", "errors"} <= set(data)
    assert data["fingerprint"]["model"] == "fixture" and data["profile"]["layer_s"]
    assert ComputeCostModel.from_json(data["predictor"]).kind == "fit"
    assert cost_model_from_json(data["roofline"]).kind == "roofline"
    assert "MAPE" in capsys.readouterr().out


def test_the_peak_matmul_grows_only_while_the_next_size_stays_within_its_time(monkeypatch):
    """A slow multiply (bfloat16 on a CPU without bf16 instructions) keeps the first size: the peak is measured in a
    bounded time, from the products it made."""
    sizes = []
    real_randn = torch.randn

    def randn(*shape, **kw):
        if len(shape) == 2 and shape[0] == shape[1]:
            sizes.append(shape[0])
        return real_randn(*shape, **kw)

    monkeypatch.setattr(cp.torch, "randn", randn)
    monkeypatch.setattr(cp, "MATMUL_SECONDS", 0.0)
    flops, bandwidth = cp.measure_peaks(torch.device("cpu"), torch.float32, repeats=1)
    assert set(sizes) == {256} and flops > 0 and bandwidth > 0
    sizes.clear()
    monkeypatch.setattr(cp, "MATMUL_SECONDS", float("inf"))
    cp.measure_peaks(torch.device("cpu"), torch.float32, repeats=1)
    assert sorted(set(sizes)) == [256, 512, 1024, 2048]  # up to the CPU's largest
