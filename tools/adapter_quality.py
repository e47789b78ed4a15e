"""The deployed configuration with each sequence's own low-rank projection (``prompt_adapter``) beside the same with
the calibrated adapter and the reuse slots the solver gave it, on the deploy's calibration windows and on other text:
perplexity ratio, top-1 agreement and KL to ``full``, and the KV bytes read a token (the deploy's adapter trial
measures the first text only).

    python -m tools.adapter_quality --config deploy/local/config.json --texts calibration,builtin
"""
import argparse
import json
from pathlib import Path

import torch

from edgekv.evals.progress import Progress
from edgekv.evals.scoring import Adapters, ConfigScorer, calibration_windows, load_text, split_text, tokenize
from edgekv.install import quality
from edgekv.runtime.model import load_model

FIELDS = ("G", "M", "C", "sigma", "reuse", "sink_tokens", "window_tokens", "klr_dtype", "kv_record_dtype",
          "io_align_bytes", "score_reduce", "correction", "correction_reads", "correction_recall", "guess_from_before",
          "prompt_adapter")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="deploy/local/config.json", help="a deployed config with an adapter trial")
    ap.add_argument("--texts", default="calibration,builtin", help="calibration (the deploy's windows) or eval texts")
    ap.add_argument("--kv-path", default=None, help="scratch KV folder (default: the config's kv_path)")
    args = ap.parse_args(argv)
    path = Path(args.config)
    if not path.is_file():
        raise SystemExit(f"--config {path} does not exist: run make deploy first, or point at its config.json")
    try:
        deployed = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise SystemExit(f"--config {path} is not a deployed config (JSON): {exc}") from exc
    trial = deployed.get("measurements", {}).get("adapter_trial")
    if trial is None:
        raise SystemExit(f"{args.config} holds no adapter trial: deploy with a quality target and solver.prompt_adapter")
    context = deployed["max_context"]
    base = {k: deployed[k] for k in FIELDS if k in deployed}
    runs = {"calibrated": {**base, "prompt_adapter": False, "C": trial["calibrated"]["C"]},
            "prompt": {**base, "prompt_adapter": True, "C": trial["prompt"]["C"]}}
    model = load_model(deployed["model"], torch.device("cpu"), torch.float32, context + 64, "native")
    for text in args.texts.split(","):
        if text == "calibration":
            windows, source = calibration_windows(deployed["model"], context, quality.WINDOWS)
        else:
            body, source = load_text(text)
            ids, _ = tokenize(deployed["model"], body)
            windows = split_text(ids, context, 0, quality.WINDOWS).windows
        with Progress(len(runs) + 1, text) as progress:
            scorer = ConfigScorer(model, args.kv_path or deployed["kv_path"],
                                  Adapters.from_files(model, {float(deployed["sigma"]): deployed["adapter_path"]}),
                                  windows, quality.continuation(context), progress, max_batch=quality.WINDOWS,
                                  label=text)
            rows = {name: scorer("kvswap", {**run, "adapter_path": deployed["adapter_path"],
                                            "max_context": context + 64}) for name, run in runs.items()}
        for name, row in rows.items():
            print(f"{text} ({source}) {name} C={runs[name]['C']}: ppl x full {row['ppl_ratio']:.4f}  top-1 "
                  f"{row['top1_agreement']:.4f}  KL {row['kl']:.4f}  {row['kv_read_bytes_per_token'] / 2**20:.2f} MiB "
                  f"read a token", flush=True)


if __name__ == "__main__":
    main()
