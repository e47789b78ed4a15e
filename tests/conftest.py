"""Shared fixtures: small random-weight checkpoints saved with save_pretrained, and KV folders."""
from __future__ import annotations

import http.server
import os
import shutil
import tempfile
import threading

import pytest
import torch

from tests import store_helpers

from edgekv.runtime.cache import cache_root  # noqa: E402
from edgekv.runtime.ggml_weights import GGML_LIB_ENV, LIBRARIES, ggml_cache_folder  # noqa: E402

# the 'ggml' weight format's library where `make ggml` built it in the user's cache: read, never written (the
# format's tests skip without it)
_GGML = ggml_cache_folder(cache_root())
if GGML_LIB_ENV not in os.environ and all((_GGML / name).is_file() for name in LIBRARIES):
    os.environ[GGML_LIB_ENV] = str(_GGML)
# the tests' caches (native reader build, GGUF conversions, measured quality choices) never touch the user's
_CACHE = tempfile.mkdtemp(prefix="edgekv-test-cache-")
os.environ["EDGEKV_CACHE"] = _CACHE
# every test computes on the CPU, whatever GPU the host has (the references are fp32 CPU runs), servers and CLI
# children included; tests marked `cuda` ask for the GPU themselves (tests/test_cuda.py)
os.environ["EDGEKV_DEVICE"] = "cpu"


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False here)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


def pytest_sessionfinish(session, exitstatus):
    shutil.rmtree(_CACHE, ignore_errors=True)

SMALL = dict(
    vocab_size=160,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
)


def save_model(path, arch: str, **overrides):
    """Save a random model of ``arch`` (llama, qwen2, qwen3, mistral, gemma3) into ``path``; returns the folder.
    gemma3: Gemma 3's text model (model_type gemma3_text) with a window of 8 tokens and Gemma 3's layer pattern
    (five local layers, then a global one) unless ``layer_types`` says otherwise."""
    from transformers import (
        Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM,
        Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM,
    )

    classes = {
        "llama": (LlamaConfig, LlamaForCausalLM, {}),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
        "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"head_dim": 16}),
        "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": None}),
        # the norms' weights random too (Gemma's are 1 + w, zero at init): a mistake in where they apply shows
        "gemma3": (Gemma3TextConfig, Gemma3ForCausalLM, {"head_dim": 16, "sliding_window": 8,
                                                         "query_pre_attn_scalar": 256}),
    }
    config_cls, model_cls, extra = classes[arch]
    torch.manual_seed(1234)
    model = model_cls(config_cls(**{**SMALL, **extra, **overrides}))
    if arch == "gemma3":
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.normal_(0.0, 0.3)
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {arch: save_model(root / arch, arch) for arch in ("llama", "qwen2", "qwen3", "mistral")}


@pytest.fixture
def kv_path(tmp_path):
    path = tmp_path / "kv"
    path.mkdir()
    return path


@pytest.fixture
def failing_build(monkeypatch):
    """``failing_build(name, what, stderr)``: the native library ``name`` fails to build as a compiler fails it
    (runtime/native_build.py's BuildError with that output); the others build as ever."""
    from edgekv.runtime import native_build

    real = native_build.build

    def fail(name: str, what: str, stderr: str) -> None:
        def build(library):
            if library == name:
                raise native_build.BuildError(what, ["cc"], stderr)
            return real(library)

        monkeypatch.setattr(native_build, "build", build)
    return fail


def run_in_threads(target, n: int) -> list[BaseException]:
    """``target()`` on ``n`` threads at once, all joined; what they raised."""
    errors = []

    def run():
        try:
            target()
        except BaseException as exc:  # noqa: BLE001 (the test asserts on it)
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return errors


def assert_same_decodes(runs: list, reference: list, dtype: str) -> None:
    """Two paths' ``generate(..., output_logits=True)`` results: the same tokens, each step's logits within float32
    sums in another order (float32) or a rounding of the dtype's (bfloat16)."""
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == "float32" else dict(atol=0.03, rtol=0.03)
    for run, ref in zip(runs, reference, strict=True):
        assert run.token_ids == ref.token_ids
        for a, b in zip(run.logits, ref.logits, strict=True):
            torch.testing.assert_close(a.float(), b.float(), **tol)


def files_under(path) -> list[str]:
    return [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs] + [
        os.path.join(d, s) for d, ss, _ in os.walk(path) for s in ss
    ]


def word_tokenizer():
    """A byte-level word tokenizer built offline: the haystack's words plus 400 synthetic words."""
    import itertools

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from edgekv.evals.tasks import HAYSTACK_TEXT

    words = sorted(set(HAYSTACK_TEXT.replace(".", " .").replace(",", " ,").split()) | {"value", "of", "is"})
    synthetic = ["".join(p) for p in itertools.islice(itertools.product("bcdfghklmnprstvz", "aeiou", "bcdfgklmnprst", "aeiou"), 400)]
    vocab = {"[UNK]": 0, "<s>": 1, ".": 2, ",": 3}
    for word in words + synthetic:
        vocab.setdefault("\u0120" + word, len(vocab))
        vocab.setdefault(word, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", unk_token="[UNK]")


def save_text_model(path):
    """A random Llama with a real (word-level) tokenizer saved beside it, like a user's checkpoint."""
    tokenizer = word_tokenizer()
    folder = save_model(path, "llama", vocab_size=len(tokenizer))
    tokenizer.save_pretrained(folder)
    return folder


CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }} : {{ m['content'] }} .{% endfor %}"
                 "{% if add_generation_prompt %}<s>assistant :{% endif %}")


def save_chat_model(path):
    """``save_text_model`` whose tokenizer carries a chat template, like an instruct checkpoint."""
    from transformers import AutoTokenizer

    folder = save_text_model(path)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)
    return folder


def tiny_deploy_profile(root, name: str, kv_paths: list, max_batch: int, context_min: int, disk_seconds: float):
    """The local profile shrunk to a seconds-long deploy (the fixture model, 2 MiB budget, 1K context, KVSwap's
    M*G rule: no quality target), written to root/name.yaml."""
    import yaml

    from edgekv.install.profile import PROFILES_DIR

    data = yaml.safe_load((PROFILES_DIR / "local.yaml").read_text())
    data["kv"]["paths"] = [str(p) for p in kv_paths]
    data["memory"] = {"max_kv_mem_mib": 2, "max_batch": max_batch, "max_context": 1024}
    data["solver"].update(g_max=8, mg_const=64, context_min=context_min, context_step=512)
    data["profiling"] = {"disk_seconds": disk_seconds, "disk_file_mib": 16}
    data["model"] = "fixture"
    data.pop("quality_target", None)
    data.pop("quality_top1_min", None)
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.fixture
def range_server(tmp_path):
    """A static HTTP server of tmp_path/published with byte ranges (tests/store_helpers.RangeHandler)."""
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), store_helpers.RangeHandler)
    srv.daemon_threads = True
    srv.root, srv.mode, srv.connections, srv.release = tmp_path / "published", "normal", 0, threading.Event()
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    srv.url = f"http://127.0.0.1:{srv.server_address[1]}/"
    yield srv
    srv.release.set()
    srv.shutdown()
    srv.server_close()
