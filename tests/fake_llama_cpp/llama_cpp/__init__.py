"""A stand-in for llama-cpp-python (import name ``llama_cpp``) where the bench's llama.cpp row needs one: its child
process (edgekv/llama_cpp_row.py) imports it when this folder is on PYTHONPATH.

It offers what that child calls, as abetlen/llama-cpp-python defines it (v0.3.35, commit 3691546f1c):
- llama_cpp/llama.py ``Llama(model_path, *, n_ctx=512, n_batch=512, n_threads=None, n_threads_batch=None, ...,
  verbose=True, **kwargs)``, a ValueError "Model path does not exist: ..." for a missing file;
- ``Llama.eval(tokens)``: the tokens after those already in the context, decoded by LlamaContext.decode
  (llama_cpp/_internals.py), which raises RuntimeError "llama_decode returned N" when llama_decode fails (as it does
  with no room left in the context);
- ``Llama.ctx``: a property, the llama_context pointer; ``Llama.n_vocab()``; ``Llama.close()``;
- llama_cpp/llama_cpp.py ``llama_get_logits(ctx)``: ``ctypes.POINTER(ctypes.c_float)`` to the last decoded token's
  logits, ``n_vocab`` floats (without logits_all, one row).
Its logits are made up: the greedy token after t is ``next_token(t)``, so a caller's greedy chain can be checked.
``FAKE_LLAMA_CPP_CRASH=SIGSEGV`` kills the process with that signal in the prompt's ``eval`` (as the wheel's AMX
matmul did on an 8K prompt), after a line on stderr as ggml's asserts write one; ``FAKE_LLAMA_CPP_HANG=1`` never
returns from the prompt's ``eval`` (a stuck thread pool); ``FAKE_LLAMA_CPP_LOG=<file>`` records each instance's
arguments and evals there as JSON.
"""
import ctypes
import json
import os
import signal
import sys
import time

N_VOCAB = 1000


def next_token(token: int) -> int:
    return (7 * token + 3) % N_VOCAB


class Llama:
    def __init__(self, model_path: str, *, n_ctx: int = 512, n_batch: int = 512, n_threads=None, n_threads_batch=None,
                 verbose: bool = True, **_):
        if not os.path.exists(model_path):
            raise ValueError(f"Model path does not exist: {model_path}")
        self._args = {"model_path": model_path, "n_ctx": n_ctx, "n_batch": n_batch, "n_threads": n_threads,
                      "n_threads_batch": n_threads_batch, "verbose": verbose, "pid": os.getpid()}
        self._evals: list[list[int]] = []
        self._logits = (ctypes.c_float * N_VOCAB)()
        self._n_tokens = 0

    @property
    def ctx(self):
        return ctypes.cast(self._logits, ctypes.c_void_p)

    def n_vocab(self) -> int:
        return N_VOCAB

    def eval(self, tokens) -> None:
        tokens = [int(t) for t in tokens]
        crash = os.environ.get("FAKE_LLAMA_CPP_CRASH")
        if crash and not self._evals:
            print(f"GGML_ASSERT failed before {crash}", file=sys.stderr, flush=True)
            os.kill(os.getpid(), getattr(signal, crash))
        while os.environ.get("FAKE_LLAMA_CPP_HANG") and not self._evals:
            time.sleep(1)
        if self._n_tokens + len(tokens) > self._args["n_ctx"]:
            raise RuntimeError("llama_decode returned 1")
        self._evals.append(tokens)
        self._n_tokens += len(tokens)
        for i in range(N_VOCAB):
            self._logits[i] = 0.0
        self._logits[next_token(tokens[-1])] = 1.0

    def close(self) -> None:
        log = os.environ.get("FAKE_LLAMA_CPP_LOG")
        if log:
            with open(log, "a") as out:
                out.write(json.dumps({**self._args, "evals": self._evals}) + "\n")


def llama_get_logits(ctx):
    return ctypes.cast(ctx, ctypes.POINTER(ctypes.c_float))
