"""Where a CPU decode step's compute thread waits, and which of its work the step waits for, in one process on one
prefilled batch:

- waits: over ``--steps`` steps, the compute thread's wall time against its own CPU time in the whole step and inside
  the policy's waits (a layer's reads, a correction, the helper's posted jobs, the jobs shared with it);
- probes: ``--probe-us`` of busy work added to the compute thread at one site every layer, each site alternating with
  no probe for ``--rounds`` rounds of ``--steps`` steps.  The step's growth over the probe's total is the share of
  that site's compute-thread time on the step's critical path: 1, all of it; 0, it hides behind a wait, so cutting
  work there gains nothing.

    python -m bench.step_waits --model smollm2 --context 8192 --batch 1 --weights int4 --dtype bfloat16 \\
        --kvswap G=4,M=205,C=256,sigma=2 --extra '{"reuse": true, "klr_dtype": "int4", ...}'
"""
import contextlib
import statistics
import threading
import time

from bench.deployed_batch import alternate, alternating_room, parser, text_batch
from edgekv.runtime.aside import AsideThread
from edgekv.runtime.model import DecoderModel
from edgekv.runtime.offload import OffloadedKV

WAITS = {"a layer's reads": (OffloadedKV, "_wait_fetch"), "a correction": (OffloadedKV, "_correct"),
         "the helper's posted jobs": (AsideThread, "wait"), "jobs shared with the helper": (AsideThread, "share")}
# where a probe runs, every layer: (class, method, before the call or after it)
PROBES = {"the layer's MLP": (DecoderModel, "finish_layer", True),
          "the next layer's selection": (OffloadedKV, "prefetch", True),
          "after the selection is launched": (OffloadedKV, "prefetch", False),
          "the layer's attention": (OffloadedKV, "_attend", True)}


@contextlib.contextmanager
def wrapped(owner, name: str, around):
    """``owner.name`` replaced by ``around(original, *args, **kwargs)`` inside the block."""
    original = getattr(owner, name)
    setattr(owner, name, lambda *a, **k: around(original, *a, **k))
    try:
        yield
    finally:
        setattr(owner, name, original)


def busy(seconds: float) -> None:
    """Compute-thread work that takes ``seconds`` and waits on nothing."""
    until = time.perf_counter() + seconds
    while time.perf_counter() < until:
        pass


def main(argv=None) -> None:
    ap = parser(__doc__, batch=1, rounds=4, setting="probe")
    ap.add_argument("--probe-us", type=float, default=50.0, help="busy work a probe adds at its site, every layer")
    args = ap.parse_args(argv)
    compute, spent = threading.get_ident(), {name: [0.0, 0.0, 0] for name in WAITS}
    probe = {"at": None, "runs": 0}

    def timed(name):
        def around(original, *a, **k):
            if threading.get_ident() != compute:
                return original(*a, **k)
            wall, cpu = time.perf_counter(), time.thread_time()
            try:
                return original(*a, **k)
            finally:
                totals = spent[name]
                totals[0] += time.perf_counter() - wall
                totals[1] += time.thread_time() - cpu
                totals[2] += 1
        return around

    def probed(name, before):
        def run():
            if probe["at"] == name:
                busy(args.probe_us * 1e-6)
                probe["runs"] += 1

        def around(original, *a, **k):
            if before:
                run()
            out = original(*a, **k)
            if not before:
                run()
            return out
        return around

    with contextlib.ExitStack() as stack:
        for name, (owner, method) in WAITS.items():
            stack.enter_context(wrapped(owner, method, timed(name)))
        for name, (owner, method, before) in PROBES.items():
            stack.enter_context(wrapped(owner, method, probed(name, before)))
        with text_batch(args, room=alternating_room(args, len(PROBES) + 1) + args.steps) as (policy, step):
            for totals in spent.values():
                totals[:] = [0.0, 0.0, 0]
            wall, cpu = time.perf_counter(), time.thread_time()
            for _ in range(args.steps):
                step()
            wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
            waits = {name: tuple(totals) for name, totals in spent.items()}
            settings = {"no probe": lambda: probe.__setitem__("at", None)}
            settings |= {name: (lambda at=name: probe.__setitem__("at", at)) for name in PROBES}
            ms, runs = alternate(step, settings, args.rounds, args.steps, lambda: (probe["runs"],))
    per_step = 1e3 / args.steps
    print(f"batch {args.batch}: {wall * per_step:.2f} ms a step, the compute thread's CPU {cpu * per_step:.2f}, "
          f"waiting {(wall - cpu) * per_step:.2f}")
    for name, (in_wall, in_cpu, calls) in waits.items():
        print(f"  in {name}: {in_wall * per_step:.2f} ms a step, CPU {in_cpu * per_step:.2f}, waiting "
              f"{(in_wall - in_cpu) * per_step:.2f} ({calls / args.steps:.1f} calls a step)")
    base = statistics.median(ms["no probe"])
    print(f"no probe: median {base:.2f} ms a step")
    for name in PROBES:
        added_ms = runs[name][0] * args.probe_us * 1e-3 / (args.rounds * args.steps)
        grew = statistics.median(ms[name]) - base
        print(f"  probe at {name}: {added_ms:.2f} ms of compute-thread work added a step, median "
              f"{statistics.median(ms[name]):.2f} ms a step: {grew / added_ms:.2f} of it on the critical path")


if __name__ == "__main__":
    main()
