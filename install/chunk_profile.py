"""Chunk compute profiler: the TTFT planner's compute_s[t, l], fitted and compared with a roofline.

``ChunkCompute.advance`` (the runtime's own code, on the real model) is timed at sampled
chunk lengths n and start positions p, for layer 0 (embedding + q/k/v) and for layers above
it (the layer below over the chunk, attention over all p + n keys, then q/k/v).  The samples
split into a fit set and a held-out set (every third sample per kind); non-negative least
squares on the physical features of ``runtime.ttft.costs`` (per-call overhead, tokens,
query-key pairs, keys), weighted by 1/time so that it minimises relative error, gives the
predictor's seconds per feature.  The roofline prices the same chunks from the model's shapes
and this device's peak matmul FLOP/s and copy bandwidth.  Both are scored on the held-out
samples (mean and max absolute percentage error).

    python -m edgekv.install.chunk_profile --model smollm2 --json chunks.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from edgekv.runtime.model import DecoderModel
from edgekv.runtime.ttft.compute import ChunkCompute, PrefixKV
from edgekv.runtime.ttft.costs import ComputeCostModel, RooflineCostModel, layer0_features, layer_features
from edgekv.runtime.weights import PackedSlice

HELD_OUT_EVERY = 3  # samples i with i % 3 == 1 (in (n, p) order, per kind) are held out of the fit


@dataclass
class ChunkProfile:
    fingerprint: dict
    n_layers: int
    layer0_s: list = field(default_factory=list)  # [n, p, seconds, held_out 0|1]
    layer_s: list = field(default_factory=list)  # [n, p, seconds, held_out 0|1] (layers >= 1)
    roofline: dict = field(default_factory=dict)  # RooflineCostModel.to_json(): model shapes + measured peaks
    seconds: float = 0.0
    loadavg: list = field(default_factory=list)  # the machine's 1-minute load before and after (other processes' share)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> "ChunkProfile":
        return cls(**data)


def sample_points(chunk_tokens_list, contexts) -> list[tuple[int, int]]:
    """(n, p): every chunk length at the prompt's start and ending at each context (p = context - n)."""
    points = set()
    for n in chunk_tokens_list:
        points.add((n, 0))
        points.update((n, c - n) for c in contexts if c > n)
    return sorted(points)


def _held_out(i: int) -> int:
    return int(i % HELD_OUT_EVERY == 1)


def _timer(device: torch.device):
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def timed(fn) -> float:
        sync()
        start = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - start

    return timed


def time_chunk(compute: ChunkCompute, span: tuple[int, int], repeats: int) -> tuple[list[float], list[float]]:
    """Seconds of ``repeats`` calls of ``advance(span, 0)`` and of ``advance(span, l >= 1)`` after a warm-up.

    Layers >= 1 are timed walking up the layers (1, 2, ...; back to 0 untimed at the top), so each
    timed call is a chunk of the executor's, with another layer's weights each time."""
    n_layers = compute.model.dims.n_layers
    timed = _timer(compute.model.device)
    compute.advance(span, 0)
    compute.advance(span, 1)
    first = [timed(lambda: compute.advance(span, 0)) for _ in range(repeats)]
    rest, at = [], 0  # the last call left the span at layer 0
    while len(rest) < repeats:
        if at == n_layers - 1:
            compute.advance(span, 0)
            at = 0
        at += 1
        rest.append(timed(lambda: compute.advance(span, at)))
    compute.drop(span)
    return first, rest


MATMUL_SECONDS = 0.25  # a peak's square matmul grows (x2 a side, x8 the time) while the next would stay under this


def measure_peaks(device: torch.device, dtype: torch.dtype, repeats: int = 5) -> tuple[float, float]:
    """(FLOP/s of a large square matmul in ``dtype``, bytes/s of a large copy) on ``device``: best of ``repeats``.
    The matmul's side doubles from 256 up to 8192 on a GPU, 2048 on a CPU, while the next size would take under
    MATMUL_SECONDS: a CPU without bf16 instructions multiplies bfloat16 through a slow fallback (a 2-core Zen 3 took
    over ten minutes for the seven 2048-side products this measured before)."""
    timed = _timer(device)
    most, size = (8192 if device.type == "cuda" else 2048), 256
    while True:
        a = torch.randn(size, size, device=device).to(dtype)
        b = torch.randn(size, size, device=device).to(dtype)
        a @ b
        seconds = min(timed(lambda: a @ b) for _ in range(repeats))
        del a, b
        if size >= most or seconds * 8 > MATMUL_SECONDS:
            break
        size *= 2
    flops = 2.0 * size**3 / seconds
    src = torch.randn(2**26 if device.type == "cuda" else 2**25, device=device).to(dtype)
    dst = torch.empty_like(src)
    dst.copy_(src)
    bandwidth = 2.0 * src.numel() * src.element_size() / min(timed(lambda: dst.copy_(src)) for _ in range(repeats))
    return flops, bandwidth


def roofline_for(model: DecoderModel, peak_flops: float, bandwidth: float) -> RooflineCostModel:
    """The roofline of ``model``'s chunks from its layer shapes (every decoder layer has the same ones)."""
    d = model.dims
    block = model.layers[0]
    params = lambda m: m.in_features * m.out_features  # noqa: E731 (a packed layer's weight is no tensor of that size)
    linears = [m for m in block.modules()  # a packed slice's weights are its fused layer's, counted once
               if hasattr(m, "in_features") and hasattr(m, "out_features") and not isinstance(m, PackedSlice)]
    attn = block.self_attn
    qkv = sum(params(m) for m in (attn.q_proj, attn.k_proj, attn.v_proj))
    intermediate = getattr(model.hf.config, "intermediate_size", None) or block.mlp.up_proj.out_features
    return RooflineCostModel.from_dims(
        hidden=d.hidden, n_heads=d.n_heads, n_kv_heads=d.n_kv_heads, head_dim=d.head_dim, intermediate=intermediate,
        layer_params=sum(map(params, linears)), qkv_params=qkv,
        elem_bytes=torch.finfo(model.dtype).bits // 8, peak_flops=peak_flops, bandwidth=bandwidth)


def n_chunk_steps(chunk_tokens_list, contexts, sweeps: int) -> int:
    """Progress ticks of ``profile_chunks``: every sample in every sweep, then the peaks."""
    return sweeps * len(sample_points(chunk_tokens_list, contexts)) + 1  # the peaks tick once, at the end


@torch.inference_mode()
def profile_chunks(model: DecoderModel, chunk_tokens_list=(256, 512, 1024), contexts=(1024, 2048, 3072, 4096, 6144, 8192),
                   repeats: int = 2, sweeps: int = 3, progress=None, fingerprint: dict | None = None,
                   seed: int = 0) -> ChunkProfile:
    """Time layer-0 and layer >= 1 chunks at ``sample_points`` (a PrefixKV of random values up to the
    largest context), measure the device's peaks, and return the samples with the roofline.

    Each sample's time is the lowest of its ``sweeps`` medians, one median of ``repeats`` calls per pass
    over all the samples: load from another process that spans a whole pass (a shared machine) spoils
    that pass's medians, not the sample, as long as one pass ran undisturbed."""
    if model.dims.n_layers < 2:
        raise ValueError("profiling chunks needs a model of at least 2 layers")
    start = time.perf_counter()
    load_before = _loadavg()
    tick = progress or (lambda: None)
    peaks = [measure_peaks(model.device, model.dtype)]  # before and after the samples; the higher of each is kept
    points = sample_points(chunk_tokens_list, contexts)
    top = max(p + n for n, p in points)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.dims.vocab, (top,), generator=gen).tolist()
    kv = PrefixKV(model, top)
    noise = torch.randn(kv.kv.shape[1:], generator=gen).to(device=model.device, dtype=model.dtype)
    kv.kv.copy_(noise.expand_as(kv.kv))  # every layer's keys before a chunk look like real K/V, not zeros
    del noise
    compute = ChunkCompute(model, ids, kv)
    profile = ChunkProfile(fingerprint or {}, model.dims.n_layers)
    times = [([], []) for _ in points]
    n, p = points[0]
    time_chunk(compute, (p, p + n), 1)  # the first calls of a process (thread pool, allocator) are slower: discarded
    for _ in range(sweeps):
        for (n, p), (first, rest) in zip(points, times):
            a, b = time_chunk(compute, (p, p + n), repeats)
            first.append(float(np.median(a)))
            rest.append(float(np.median(b)))
            tick()
    for i, ((n, p), (first, rest)) in enumerate(zip(points, times)):
        profile.layer0_s.append([n, p, min(first), _held_out(i)])
        profile.layer_s.append([n, p, min(rest), _held_out(i)])
    del compute, kv
    peaks.append(measure_peaks(model.device, model.dtype))  # (another process's load lowers one, not both)
    profile.roofline = roofline_for(model, max(f for f, _ in peaks), max(b for _, b in peaks)).to_json()
    tick()
    profile.seconds = round(time.perf_counter() - start, 1)
    profile.loadavg = [load_before, _loadavg()]
    return profile


def _loadavg() -> float | None:
    return round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None


# ---- the fit and its errors -------------------------------------------------------------------

def fit_coeffs(features: np.ndarray, seconds: np.ndarray) -> np.ndarray:
    """Non-negative seconds per feature minimising the relative error: NNLS on rows scaled by 1/seconds."""
    from scipy.optimize import nnls

    features, seconds = np.asarray(features, dtype=np.float64), np.asarray(seconds, dtype=np.float64)
    if np.any(seconds <= 0):
        raise ValueError("timings must be positive")
    scaled = features / seconds[:, None]
    norms = np.linalg.norm(scaled, axis=0)
    norms[norms == 0] = 1.0  # features span orders of magnitude: solve on unit columns, scale back
    coeffs, _ = nnls(scaled / norms, np.ones(len(seconds)))
    return coeffs / norms


def _rows(rows, held: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    picked = np.array([r for r in rows if held is None or r[3] == held], dtype=np.float64).reshape(-1, 4)
    return picked[:, 0], picked[:, 1], picked[:, 2]


def fit_predictor(profile: ChunkProfile) -> ComputeCostModel:
    """The predictor fitted on the profile's fit samples (held-out ones left out)."""
    n0, _, s0 = _rows(profile.layer0_s, held=0)
    n, p, s = _rows(profile.layer_s, held=0)
    return ComputeCostModel(tuple(fit_coeffs(layer0_features(n0), s0)), tuple(fit_coeffs(layer_features(n, p), s)))


def _errors(predicted: np.ndarray, measured: np.ndarray) -> dict:
    if not len(measured):
        return {"mape": None, "max_ape": None, "n": 0}
    ape = np.abs(predicted - measured) / measured * 100
    return {"mape": round(float(ape.mean()), 2), "max_ape": round(float(ape.max()), 2), "n": int(len(measured))}


def fit_report(profile: ChunkProfile) -> dict:
    """The fitted predictor, the roofline, and both models' percentage errors per kind (layer0, layer >= 1)
    on the fit samples and on the held-out samples."""
    predictor = fit_predictor(profile)
    roofline = RooflineCostModel.from_json(profile.roofline)
    errors = {}
    for kind, rows, layer0 in (("layer", profile.layer_s, False), ("layer0", profile.layer0_s, True)):
        errors[kind] = {}
        for split, held in (("fit", 0), ("held_out", 1)):
            n, p, s = _rows(rows, held)
            errors[kind][split] = {name: _errors(model.chunk_s(n, p, layer0=layer0), s)
                                   for name, model in (("predictor", predictor), ("roofline", roofline))}
    return {"predictor": predictor.to_json(), "roofline": roofline.to_json(), "errors": errors}


def format_report(profile: ChunkProfile, report: dict) -> str:
    fp = profile.fingerprint
    r = report["roofline"]
    lines = [f"chunk compute: {fp.get('model', '?')} ({profile.n_layers} layers) on {fp.get('device', '?')} "
             f"{fp.get('dtype', '?')}: {len(profile.layer_s)} chunk samples in {profile.seconds} s; "
             f"peak {r['peak_flops'] / 1e9:.1f} GFLOP/s, copy {r['bandwidth'] / 1e9:.1f} GB/s; "
             f"load average {' -> '.join(str(x) for x in profile.loadavg) or '?'}",
             f"{'':23}{'predictor':>20}{'roofline':>20}",
             f"{'':23}{'MAPE %':>10}{'max %':>10}{'MAPE %':>10}{'max %':>10}"]
    for kind, label in (("layer", "layer>=1"), ("layer0", "layer 0")):
        for split in ("fit", "held_out"):
            e = report["errors"][kind][split]
            cells = "".join(f"{_pct(e[m][k]):>10}" for m in ("predictor", "roofline") for k in ("mape", "max_ape"))
            lines.append(f"{label + ' ' + split.replace('_', '-'):<18}n={e['predictor']['n']:<3}{cells}")
    return "\n".join(lines)


def _pct(x) -> str:
    return "-" if x is None else f"{x:.1f}"


# ---- CLI ----------------------------------------------------------------------------------------

def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(","))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m edgekv.install.chunk_profile", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="fixture", help="fixture, smollm2, or a checkpoint folder / .gguf file")
    parser.add_argument("--json", help="write the profile, the fitted coefficients and the errors here")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--dtype", default=None, help="float32, bfloat16, float16 (default: float32 on CPU, bfloat16 on CUDA)")
    parser.add_argument("--chunks", type=_ints, default=(256, 512, 1024), help="chunk lengths, comma-separated")
    parser.add_argument("--contexts", type=_ints, default=(1024, 2048, 3072, 4096, 6144, 8192),
                        help="chunk ends (keys attended), comma-separated")
    parser.add_argument("--repeats", type=int, default=2, help="timed calls per sample and sweep")
    parser.add_argument("--sweeps", type=int, default=3, help="passes over all samples (each sample keeps its lowest pass median)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)

    from edgekv.runtime.checkpoints import resolve_checkpoint
    from edgekv.runtime.model import load_model

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    model = load_model(resolve_checkpoint(args.model), device, dtype, max(args.contexts))
    fingerprint = {"model": str(args.model), "device": str(device), "dtype": str(dtype).removeprefix("torch."),
                   "torch": torch.__version__, "threads": torch.get_num_threads(), "chunks": list(args.chunks),
                   "contexts": list(args.contexts), "repeats": args.repeats, "sweeps": args.sweeps}
    from tqdm import tqdm

    with tqdm(total=n_chunk_steps(args.chunks, args.contexts, args.sweeps), desc="chunk profile", file=sys.stderr,
              disable=args.quiet, ncols=80) as bar:
        profile = profile_chunks(model, args.chunks, args.contexts, args.repeats, args.sweeps, progress=bar.update,
                                 fingerprint=fingerprint)
    report = fit_report(profile)
    print(format_report(profile, report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"fingerprint": fingerprint, "profile": profile.to_json(), **report}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
