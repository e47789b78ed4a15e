"""The human-readable install report: what was measured, what was chosen and why (text + PNG)."""
from __future__ import annotations

from pathlib import Path

from .solver import target_words


def write(out: Path, prof, model_dir, measurements: dict, solutions, stats, tuning_s: float) -> None:
    lines = [f"edgekv install report: platform {prof.platform} ({prof.source})", f"model {model_dir}",
             "facts: " + ", ".join(f"{k}={v}" for k, v in measurements.get("platform", {}).items()), ""]
    lines += _disk_lines(measurements["disk"])
    c, w = measurements["compute"], measurements.get("weights") or {}
    lines += ["", f"weights: {w.get('chosen', 'native')}" + "".join(
        f"; {t['weights']} " + (f"ppl {t['ppl_ratio']}x, top-1 {t['top1_agreement']}" if t["ppl_ratio"] is not None
                                else "not run here") for t in w.get("trials", []))
              + (f" (limit {w['ppl_max']:g}x the model's own weights)" if w.get("trials") else "")]
    dt = measurements.get("dtype") or {}
    if dt.get("trials"):
        lines.append(f"dtype: {dt['chosen']}" + "".join(
            f"; {t['dtype']} ppl {t['ppl_ratio']}x float32's, top-1 {t['top1_agreement']}, one step {t['step_ms']} ms, "
            f"prefill {t.get('prefill_ms', '-')} ms"
            + (f" ({t['note']})" if t["note"] else "") for t in dt["trials"]) + f" (limit {dt['ppl_max']:g}x)")
    lines += [f"compute ({c['device']}, {c['dtype']}, weights {w.get('chosen', 'native')}), one block, ms: "
              + ", ".join(f"b={b} {t} tokens {ms:.2f}" for b, t, ms in c["block_ms"][:6]), ""]
    lines.append("reuse rate vs C/M (lookup table): " + "; ".join(
        f"G={g}: " + " ".join(f"{float(r):g}->{v:.2f}" for r, v in rows.items()) for g, rows in measurements["reuse_table"].items()))
    local = measurements.get("window_layers")
    if local:
        lines.append(f"hybrid attention: {local['local_layers']} of {local['layers']} layers attend to their last "
                     f"{'/'.join(map(str, local['window_tokens']))} tokens: their KV is a ring in memory of "
                     f"{local['ring_mib']:g} MiB for {prof.max_batch} x {prof.max_context} tokens, where treating them "
                     f"as global would store {local['as_global_mib']:g} MiB; the policy and the solver size only the "
                     f"global layers' KV ({local['global_layers_full_kv_mib']:g} MiB in full)")
    scoring = measurements.get("scoring")
    if scoring:
        lines += ["", f"HillInfer pools: in-storage scorer {scoring['scorer_backend']}, f_cpu {scoring['f_cpu_tok_s']:.3g} "
                  f"tok/s, f_ssd {scoring['f_ssd_tok_s']:.3g} tok/s, beta {scoring['beta']:.3f}"]
        if scoring["emulated"]:
            lines.append("  no SmartSSD: f_ssd is the host CPU running the kernel's C-simulation, not the card's; beta "
                         "was set from it and the scored keys were read into host memory, not kept in storage")
    table = measurements.get("quality_table") or []
    if table:
        lines += ["", f"quality table (ppl ratio / top-1 agreement vs full on calibration text), target "
                  f"{target_words(prof.quality_target, prof.quality_top1_min)}:", f"{'context':>7} {'G':>3} {'M*G':>5} {'sigma':>5} {'S':>3} {'W':>4} "
                  f"{'K_lr':>8} {'select':>9} {'ppl x':>6} {'top-1':>6}"]
        lines += [f"{p['context']:>7} {p['G']:>3} {p['mg_tokens']:>5} {p['sigma']:>5g} {p['sink_tokens']:>3} "
                  f"{p['window_tokens']:>4} {p.get('klr_dtype', 'bfloat16'):>8} {p.get('correction', 'guess'):>9} "
                  f"{p['ppl_ratio']:6.3f} {p['top1_agreement']:6.3f}" for p in table]
    if solutions:
        lines += ["", f"budget {prof.max_kv_mem_mib:g} MiB for {prof.max_batch} x {prof.max_context} tokens "
                  f"({prof.batch_budget_mib:.2f} MiB per sequence), exposed I/O share {prof.exposed_io_share}, MG const {prof.mg_const}",
                  f"{'batch':>5} {'context':>7} {'G':>3} {'M':>4} {'C':>4} {'sigma':>5} {'reuse':>5} {'hit':>5} "
                  f"{'T_io ms':>8} {'T_model ms':>10} {'hidden':>6} {'MG<const':>8} {'S':>3} {'W':>4} {'select':>9} {'fix ms':>6} "
                  f"{'ppl x':>6} {'top-1':>6} {'target':>6}"]
        for s in solutions:
            lines.append(f"{s.batch:>5} {s.context:>7} {s.G:>3} {s.M:>4} {s.C:>4} {s.sigma:>5g} {str(s.reuse):>5} "
                         f"{s.reuse_rate:5.2f} {s.t_io_ms:8.2f} {s.t_model_ms:10.2f} {str(s.hidden):>6} {str(s.mg_scaled):>8} "
                         f"{s.sink_tokens:>3} {s.window_tokens:>4} {s.correction:>9} {s.t_correct_ms:6.2f} "
                         f"{_opt(s.ppl_ratio):>6} {_opt(s.top1_agreement):>6} {_met(s.quality_met):>6}")
        _plot_solutions(out / "solutions.png", solutions)
    if stats:
        lines += ["", "smoke generation: " + ", ".join(f"{k}={v}" for k, v in stats.items())]
    lines += ["", f"tuning time {tuning_s:.0f} s"]
    (out / "report.txt").write_text("\n".join(lines) + "\n")


def _disk_lines(d: dict) -> list[str]:
    """Each KV path (device, filesystem, O_DIRECT, its rates; its rate at the chosen record size once solved), the
    devices that hold several paths, and with several paths the aggregate the solver planned with."""
    at = d.get("at_record")
    where = f" at {_size(at['block_bytes'])} records, qd {at['queue_depth']}" if at else ""
    paths = d["paths"]
    lines = [f"disk: {len(paths)} KV paths, each profiled alone; records spread evenly over them" if len(paths) > 1
             else "disk:"]
    for i, p in enumerate(paths):
        fp = p["fingerprint"]
        rate = f"; {at['paths_mib_s'][i]:.1f} MiB/s{where}" if at else ""
        lines += [f"path {i + 1} {p['kv_path']}: {fp.get('source')} ({fp.get('fs')}, device "
                  f"{fp.get('disk', fp.get('dev'))}), reference {p['reference']}, reader {p['reader']}, "
                  f"O_DIRECT={p['o_direct']}{rate}",
                  *_rate_table(p["points"])]
    if d.get("gap_bytes") is not None and at:
        records = d["gap_bytes"] // at["block_bytes"]
        lines.append(f"gaps read through: {records} records of {_size(at['block_bytes'])} (io_gap_bytes "
                     f"{d['gap_bytes']}: a request costs as much as that many bytes more)" if records else
                     f"gaps read through: none (io_gap_bytes {d['gap_bytes']}: a request costs less than a record more)")
    for dev, on in d.get("shared_devices", {}).items():
        lines.append(f"WARNING: KV paths {', '.join(on)} are on one device ({dev}): no extra bandwidth, counted once")
    if len(paths) > 1:
        rate = f": {at['plan_mib_s']:.1f} MiB/s{where}" if at else ""
        lines += [f"plan: the solver's rate with {len(paths)} paths (N x the slowest path, a shared device once){rate}",
                  *_rate_table(d["points"])]
    return lines


def _rate_table(points: list[dict]) -> list[str]:
    lines = [f"{'block':>8} {'qd':>3} {'disk MiB/s':>11} {'reader MiB/s':>13} {'reader/disk':>12}"]
    for p in points:
        fio = f"{p['fio_mib_s']:11.1f}" if p["fio_mib_s"] else f"{'-':>11}"
        eff = f"{p['reader_mib_s'] / p['fio_mib_s']:12.2f}" if p["fio_mib_s"] else f"{'-':>12}"
        lines.append(f"{_size(p['block_bytes']):>8} {p['queue_depth']:>3} {fio} {p['reader_mib_s']:13.1f} {eff}")
    return lines


def _opt(x) -> str:
    return "-" if x is None else f"{x:.3f}"


def _met(met) -> str:
    return {None: "-", True: "met", False: "MISSED"}[met]


def _size(n: int) -> str:
    return f"{n // 1024}K" if n >= 1024 else f"{n}B"


def _plot_solutions(png: Path, solutions) -> None:
    """T_io vs T_model per (batch, context), with the chosen G: where the I/O hides behind compute."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    for i, context in enumerate(sorted({s.context for s in solutions})):
        rows = sorted((s for s in solutions if s.context == context), key=lambda s: s.batch)
        b = [s.batch for s in rows]
        ax1.plot(b, [s.t_model_ms for s in rows], "-o", color=f"C{i}", label=f"T_model {context}")
        ax1.plot(b, [s.t_io_ms for s in rows], "--x", color=f"C{i}", label=f"T_io {context}")
        ax2.plot(b, [s.G for s in rows], "-o", color=f"C{i}", label=f"G, context {context}")
    ax1.set_xlabel("batch")
    ax1.set_ylabel("ms per decode step")
    ax1.legend(fontsize=7)
    ax2.set_xlabel("batch")
    ax2.set_ylabel("chosen group size G")
    ax2.legend(fontsize=7)
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
