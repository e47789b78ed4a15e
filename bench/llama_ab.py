"""edgekv beside llama.cpp at batch 1 in one process, their decode steps alternating round by round: the same GGUF,
the same text (its first ``--context`` tokens prefilled, each step feeding the text's next token), llama.cpp on as
many threads as torch.  ``edgekv bench`` runs its rows one after another, a minute apart; on a machine whose speed
drifts by a third within minutes (this 2-core VM) their ratio moves with the drift, which here falls on every side.

    python -m bench.llama_ab --model smollm2 --context 8192 --weights ggml --policies full,kvswap --rounds 6
"""
import contextlib
import statistics

import torch

from bench.deployed_batch import alternate, alternating_room, parser, text_batch, text_ids
from edgekv.bench import llama_cpp_source
from edgekv.runtime.checkpoints import resolve_checkpoint

LLAMA = "llama.cpp"


@contextlib.contextmanager
def llama_steps(model: str, text: str, context: int, room: int):
    """A function taking one llama.cpp decode step over ``text`` after its first ``context`` tokens."""
    gguf, note = llama_cpp_source(resolve_checkpoint(model), [LLAMA])
    if gguf is None:
        raise SystemExit(f"no llama.cpp side: {note}")
    import llama_cpp

    ids = text_ids(model, text, context + room)
    threads = torch.get_num_threads()
    llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=context + room, n_threads=threads, n_threads_batch=threads,
                          n_batch=512, verbose=False)
    try:
        llm.eval(ids[:context])
        made = [0]

        def step() -> None:
            llm.eval([ids[context + made[0]]])
            made[0] += 1

        yield step
    finally:
        llm.close()


def main(argv=None) -> None:
    ap = parser(__doc__, batch=1, rounds=6, steps=6, setting="side")
    ap.add_argument("--policies", default="full", help="edgekv's sides, comma-separated (kvswap: --kvswap, --extra)")
    args = ap.parse_args(argv)
    if args.batch != 1:
        raise SystemExit("--batch: llama-cpp-python decodes one sequence; the comparison runs at batch 1")
    policies = args.policies.split(",")
    room = alternating_room(args, len(policies) + 1)
    with contextlib.ExitStack() as stack:
        sides = {p: stack.enter_context(text_batch(args, room, policy=p))[1] for p in policies}
        sides[LLAMA] = stack.enter_context(llama_steps(args.model, args.text, args.context, room))
        for _ in range(8):
            sides[LLAMA]()
        current = [sides[policies[0]]]
        ms, _ = alternate(lambda: current[0](), {name: (lambda s=s: current.__setitem__(0, s))
                                                 for name, s in sides.items()}, args.rounds, args.steps)
    base = statistics.median(ms[LLAMA])
    print(f"# {args.model} {args.context} tokens, batch 1, weights {args.weights}, dtype {args.dtype or 'float32'}, "
          f"{torch.get_num_threads()} threads; median of {args.rounds} alternating rounds of {args.steps} steps")
    for name, runs in ms.items():
        median = statistics.median(runs)
        ratios = [mine / theirs for mine, theirs in zip(ms[LLAMA], runs)]  # each round's llama.cpp step over this
        print(f"{name:10s} {median:6.1f} ms a step, {1e3 / median:5.1f} tok/s, {base / median:.2f}x llama.cpp "
              f"(per round {min(ratios):.2f}-{max(ratios):.2f}; steps {', '.join(f'{r:.0f}' for r in runs)})")


if __name__ == "__main__":
    main()
