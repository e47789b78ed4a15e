"""The llama.cpp row of `edgekv bench` in a process of its own: ``python -m edgekv.llama_cpp_row``.

llama-cpp-python's native code can kill the process it runs in (seen: SIGSEGV in ggml's AMX matmul on a VM that lists
AMX but faults in it); in a child of its own that ends this row only, and the bench's other rows are still measured
and written.  The request comes as one JSON object on stdin (``decode_steps_ns``'s arguments), the step times go back
as the last line of stdout.  Only llama_cpp and numpy are imported here: nothing of edgekv's own native libraries,
which load ggml by the same library names, shares the process with the wheel's."""
import json
import sys
import time

import numpy as np


def decode_steps_ns(gguf: str, prompt: list[int], context: int, steps: int, threads: int) -> list[int]:
    """Nanoseconds of each of ``steps`` greedy decode steps after ``prompt``, each timed around ``eval`` of one
    token, on ``threads`` threads (prefill and decode alike) with an ``context``-token cache."""
    import llama_cpp

    llm = llama_cpp.Llama(model_path=gguf, n_ctx=context, n_threads=threads, n_threads_batch=threads, n_batch=512,
                          verbose=False)
    try:
        llm.eval(prompt)
        step_ns = []
        for _ in range(steps):
            # without logits_all the high-level API keeps no scores: read the last token's logits from the context
            token = int(np.argmax(np.ctypeslib.as_array(llama_cpp.llama_get_logits(llm.ctx), shape=(llm.n_vocab(),))))
            start = time.perf_counter_ns()
            llm.eval([token])
            step_ns.append(time.perf_counter_ns() - start)
    finally:
        llm.close()
    return step_ns


def main() -> None:
    step_ns = decode_steps_ns(**json.load(sys.stdin))
    print(json.dumps({"step_ns": step_ns}), flush=True)


if __name__ == "__main__":
    main()
