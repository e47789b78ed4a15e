"""The linear layers' weight formats: what each costs per token and what it keeps.

- ``native``: as loaded (a GGUF is dequantised to the model's dtype: SmolLM2's Q4_1 file becomes 540 MB of fp32
  read per token).
- ``int8``: PyTorch's dynamic int8 linear (weights int8 a scale per output row, activations quantized per call;
  fbgemm). 1.3-1.8x fp32's decode speed on SmolLM2 and 1.37x its perplexity: activations quantized
  per call are what SmolLM2 does not survive. Measured, never chosen.
- ``int4``: weight-only, 4 bits in groups of ``INT4_GROUP`` inputs with a scale and a minimum each (torch's CPU
  kernel ``_weight_int4pack_mm_for_cpu``), for the layers whose weights already lie on such a grid: a GGUF
  Q4_0/Q4_1 block or Q4_K sub-block is one, so those tensors keep it, with its scale and minimum rounded to
  bfloat16 (the kernel's); the activations cross it in bfloat16. A layer off a 4-bit grid (a 5-, 6- or 8-bit
  GGUF tensor, fp16 weights) or one it cannot pack (outputs not a multiple of 16, inputs not of the group) is int8
  weight-only (``_weight_int8pack_mm``, a scale per row): 4 bits over other grids cost Gemma 3 270M 1.198x its
  perplexity, its own grids in 4 bits and int8 elsewhere 0.994x. The output head is int8
  weight-only too, with each row's best few logits computed again in fp32 (``RescoredHead``); a layer neither
  kernel takes (inputs not a multiple of 16) stays as loaded.
  Attention's q/k/v are packed as one layer and the MLP's gate/up as another (``PackedSlice``): four kernel calls
  a block where there were seven (SmolLM2 8K full step 30.7 -> 28.8 ms).
  SmolLM2 (Q4_1 GGUF): ppl 1.0007x fp32, top-1 agreement 0.990, decode 2x fp32's speed at 8K.
- ``ggml``: each layer in the smallest GGUF block type that gives its weight back (a Q4_1 file's own blocks), else
  Q8_0, computed by ggml's CPU dot products with 8-bit activations, as llama.cpp computes the same file
  (runtime/ggml_weights.py; the library ``make ggml`` builds, or llama-cpp-python's).  q/k/v and gate/up packed as
  for int4, the head Q8_0 rescored.  SmolLM2 8K, full, batch 1: 1.47x int4's tok/s, ppl 1.004x fp32.

The weight-only kernels run fast with bfloat16 activations only (AVX-512 BF16 / AMX; in fp16 or fp32 they are
10-40x slower than an fp32 GEMV on the same CPU), so ``int4`` runs on a CPU in a float32 model, whose norms, RoPE,
attention and KV stay in fp32 and whose activations are cast to bfloat16 at each linear layer, or in a bfloat16
model, which feeds the kernels as it is and attends over a bf16 KV (half the bytes: SmolLM2 8K, 29.2 -> 22.7 ms a
step; its perplexity is the dtype's, measured apart).
"""
from __future__ import annotations

import torch
from torch import nn

from .errors import ModelError
from .ggml_weights import (GGML_BLOCK, GgmlBlockEnd, GgmlHeads, GgmlMatmul, blocks_for, dequantized, ggml,
                           ggml_unavailable)
from .norms import RmsNorm, norm_call, rms_norm_of

WEIGHT_FORMATS = ("native", "int8", "int4", "ggml")
INT4_GROUP = 32  # inputs per scale/minimum: a GGUF Q4_0/Q4_1 block, a Q4_K sub-block
INT4_ROWS = 16  # the int4 CPU packing takes outputs in multiples of this
# a weight lies on a 4-bit grid when its groups found again (``_int4_grid``) are within this share of its norm: 0 for
# SmolLM2's Q4_1 tensors and Gemma 3 270M's Q4_K ones, 0.08-0.10 for its Q5_0 ones
INT4_GRID_ERROR = 1e-3
INT8_INPUTS = 16  # the int8 kernel takes inputs in multiples of this (torch 2.13 crashes on others)
ACTIVATION_DTYPE = torch.bfloat16  # the weight-only kernels' fast path
# the model dtypes each format runs in: a bfloat16 model feeds the kernels as they are (and attends over a bf16 KV)
FORMAT_DTYPES = {"int8": (torch.float32,), "int4": (torch.float32, torch.bfloat16),
                 "ggml": (torch.float32, torch.bfloat16)}
KERNELS = {"int8": "PyTorch's dynamic int8 linear", "int4": "torch's int4 weight-only kernel",
           "ggml": "ggml's CPU dot products"}


class WeightFormatError(ModelError):
    """A weight format the device, dtype or torch build cannot run; the message names the fix."""


class PackedLinear(nn.Module):
    """A linear layer whose weight is packed for one of torch's weight-only CPU kernels: the input crosses in
    bfloat16, the output returns in the caller's dtype, the bias (if any) is added in that dtype."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x.reshape(-1, self.in_features).to(ACTIVATION_DTYPE))
        y = y.to(x.dtype).view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def dequantized(self) -> torch.Tensor:
        """The weight [out, in] in float32, as the kernel computes with it."""
        raise NotImplementedError

    def rows_call(self, start: int, stop: int):
        """A function of x giving outputs ``start:stop`` alone: here the whole layer cut (a format whose kernel can
        compute a run of rows alone overrides it)."""
        return lambda x: self.forward(x)[..., start:stop]


class Int8Linear(PackedLinear):
    """Weight-only int8, symmetric, a scale per output row."""

    def __init__(self, linear: nn.Linear):
        super().__init__(linear)
        w = linear.weight.detach().float()
        scale = (w.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny)
        self.register_buffer("qweight", torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8))
        self.register_buffer("kernel_scale", scale.to(ACTIVATION_DTYPE))

    def matmul(self, x):
        return torch.ops.aten._weight_int8pack_mm(x, self.qweight, self.kernel_scale)

    def dequantized(self):
        return self.qweight.float() * self.kernel_scale.float()[:, None]


class Int4Linear(PackedLinear):
    """Weight-only int4 in groups of INT4_GROUP inputs, each with its own scale and minimum (the grid min + scale·q,
    q in 0..15: a GGUF Q4_1 block's own grid, found again from its dequantised values)."""

    def __init__(self, linear: nn.Linear, grid: tuple[torch.Tensor, ...] | None = None):
        """``grid``: the weight's (q, scale, minimum) from ``_int4_grid``, if already found."""
        super().__init__(linear)
        q, scale, low = _int4_grid(linear.weight) if grid is None else grid
        q = q.to(torch.int32).view(self.out_features, -1)
        self.register_buffer("qweight", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1))
        # the kernel's convention: w = (q - 8)·scale + zero, per [group, output]
        scale_zero = torch.stack([scale, low + 8 * scale], dim=-1).squeeze(-2).transpose(0, 1)
        self.register_buffer("scale_zero", scale_zero.contiguous().to(ACTIVATION_DTYPE))

    def matmul(self, x):
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.qweight, INT4_GROUP, self.scale_zero)

    def dequantized(self):  # the kernel's own product with the identity, rounded to bfloat16 as its outputs are
        return self.matmul(torch.eye(self.in_features, dtype=ACTIVATION_DTYPE)).float().t().contiguous()


class GgmlLinear(PackedLinear):
    """A GGUF block type computed by ggml's CPU kernels (runtime/ggml_weights.py): the input crosses in float32 and is
    quantized to 8 bits per block there, as llama.cpp quantizes it."""

    def __init__(self, linear: nn.Linear):
        super().__init__(linear)
        lib = ggml()
        self.kernel = GgmlMatmul(lib, *blocks_for(lib, linear.weight), self.in_features)
        self.kernels = [self.kernel]  # and its row runs (``rows_call``): the helper thread is lent to each
        self._row_runs: dict[tuple[int, int], GgmlMatmul] = {}  # (start, stop) -> its kernel, made once

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._through(self.kernel, self.bias, x)

    def _through(self, kernel: GgmlMatmul, bias: torch.Tensor | None, x: torch.Tensor, norm: RmsNorm | None = None
                 ) -> torch.Tensor:
        y = kernel(x.reshape(-1, self.in_features), norm).view(*x.shape[:-1], kernel.rows)
        if x.dtype != y.dtype:
            y = y.to(x.dtype)
        return y if bias is None else y + bias

    def normed_call(self, norm: RmsNorm):
        """A function of x giving the layer's output for x RMS-normed by ``norm``, normed in the kernel's call."""
        return lambda x: self._through(self.kernel, self.bias, x, norm)

    def rows_call(self, start, stop, norm: RmsNorm | None = None):
        """Outputs ``start:stop`` by a kernel over those rows' blocks alone (a view, no copy): each output is its own
        row's dot product, so they are the whole layer's to the bit (the next layer's query: q without k and v);
        ``norm``: of x RMS-normed, as ``normed_call``."""
        kernel = self.row_kernel(start, stop)
        bias = None if self.bias is None else self.bias[start:stop]
        return lambda x: self._through(kernel, bias, x, norm)

    def row_kernel(self, start: int, stop: int) -> GgmlMatmul:
        """The kernel of outputs ``start:stop`` alone, made once (a slice's calls share it)."""
        kernel = self._row_runs.get((start, stop))
        if kernel is None:
            kernel = self._row_runs[start, stop] = self.kernel.row_run(start, stop)
            self.kernels.append(kernel)
        return kernel

    def dequantized(self):
        k = self.kernel
        return dequantized(k.lib, k.type_name, k.blocks, self.in_features)


class PackedSlice(nn.Module):
    """One projection of several packed as one layer (q/k/v, or gate/up, each a slice of the outputs): called alone,
    as the Hugging Face modules call it, it computes the whole layer and keeps its slice; ``DecoderModel`` calls the
    shared layer once instead (``packed_call``), one kernel call where there were two or three."""

    def __init__(self, fused: PackedLinear, start: int, stop: int):
        super().__init__()
        self._fused = (fused,)  # not a submodule: the fused layer belongs to the block, once
        self.start, self.stop = start, stop
        self.in_features, self.out_features = fused.in_features, stop - start
        self._call = fused.rows_call(start, stop)

    @property
    def fused(self) -> PackedLinear:
        return self._fused[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._call(x)

    def normed_call(self, norm: RmsNorm):
        """As ``GgmlLinear.normed_call``, over this slice's rows; None where the packed layer takes no norm."""
        return self.fused.rows_call(self.start, self.stop, norm) if hasattr(self.fused, "normed_call") else None

    def dequantized(self) -> torch.Tensor:
        return self.fused.dequantized()[self.start:self.stop]


def normed_call(norm: nn.Module | None, layer: nn.Module):
    """A function of x giving ``layer(norm(x))`` (``norm`` None: ``layer(x)``): one call where the layer's kernel
    takes a Llama- or Gemma-3-style RMS norm on its input (weights 'ggml'), the two calls otherwise."""
    if norm is None:
        return layer.forward
    taken = getattr(layer, "normed_call", None)
    spec = rms_norm_of(norm) if taken is not None else None
    call = taken(spec) if spec is not None else None
    if call is not None:
        return call
    first, then = norm_call(norm), layer.forward
    return lambda x: then(first(x))


def packed_call(*projections: nn.Module, norm: nn.Module | None = None):
    """(a function of x giving each projection's output for ``norm(x)`` (or x), whether they share one packed
    layer): one call of the packed layer (``normed_call``) cut into its slices where they do, else each
    projection's own ``forward`` of the normed x."""
    fused = getattr(projections[0], "fused", None)
    if fused is None or any(getattr(p, "fused", None) is not fused for p in projections):
        calls = tuple(p.forward for p in projections)
        first = norm_call(norm) if norm is not None else (lambda x: x)
        return (lambda x: tuple(call(h) for h in (first(x),) for call in calls)), False
    forward, cuts = normed_call(norm, fused), tuple(slice(p.start, p.stop) for p in projections)

    def call(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y = forward(x)
        return tuple(y[..., cut] for cut in cuts)
    return call, True


def heads_call(layer: nn.Module, norm: nn.Module, head_dim: int, q_heads: int, k_heads: int = 0) -> GgmlHeads | None:
    """``layer`` of x normed by ``norm``, cut into heads and RoPE'd in one native call where it is ggml's and the norm
    Llama's or Gemma 3's: a packed q/k/v ``GgmlLinear`` (``k_heads`` > 0), or q's ``PackedSlice`` of one (the next
    layer's query); else None."""
    spec = rms_norm_of(norm)
    if spec is None or head_dim % 2:
        return None
    if isinstance(layer, GgmlLinear):
        return GgmlHeads(layer.kernel, layer.bias, spec, head_dim, q_heads, k_heads)
    fused = getattr(layer, "fused", None)
    if isinstance(layer, PackedSlice) and isinstance(fused, GgmlLinear):
        bias = None if fused.bias is None else fused.bias[layer.start : layer.stop]
        return GgmlHeads(fused.row_kernel(layer.start, layer.stop), bias, spec, head_dim, q_heads, k_heads)
    return None


def block_end(o_proj: nn.Module, mlp: nn.Module, norm: nn.Module) -> GgmlBlockEnd | None:
    """A block's end (its output projection, residual, MLP norm, gated MLP, residual) in one native call where every
    part is ggml's and Llama's: ``o_proj``, the packed gate/up layer (gate's outputs first) and down ``GgmlLinear``
    (with their biases, if any), an activation that is SiLU to the bit and a Llama- or Gemma-3-style norm; else
    None."""
    gate, up, down = (getattr(mlp, name, None) for name in ("gate_proj", "up_proj", "down_proj"))
    fused = getattr(gate, "fused", None)
    if not (isinstance(o_proj, GgmlLinear) and isinstance(down, GgmlLinear) and isinstance(fused, GgmlLinear)
            and getattr(up, "fused", None) is fused):
        return None
    ff = down.in_features
    if (gate.start, gate.stop, up.start, up.stop, fused.out_features) != (0, ff, ff, 2 * ff, 2 * ff):
        return None
    spec = rms_norm_of(norm)
    if spec is None or not _is_silu(getattr(mlp, "act_fn", None)):
        return None
    return GgmlBlockEnd(o_proj.kernel, fused.kernel, down.kernel, spec, (o_proj.bias, fused.bias, down.bias))


def _is_silu(act) -> bool:
    """Whether ``act`` computes torch's SiLU (transformers' ``SiLUActivation``, ``nn.SiLU``), tried on a probe."""
    if not callable(act):
        return False
    probe = torch.linspace(-30.0, 30.0, 121)
    try:
        return torch.equal(act(probe), torch.nn.functional.silu(probe))
    except (TypeError, RuntimeError):
        return False


class RescoredHead(nn.Module):
    """The output head in int8 with its top candidates scored again in the model's dtype. The int8 kernel's logits
    come back in bfloat16, a step of 0.125 at 20, enough to swap the two likeliest tokens (SmolLM2: top-1 agreement
    with fp32 0.960, ppl 1.0023x); each row's ``top`` best are computed again from the original weight (a tied head's
    is the embedding, held anyway), which gives back fp32's choice (0.990) for ``top`` dot products a row."""

    def __init__(self, linear: nn.Linear, top: int = 8, approx: type[PackedLinear] | None = None):
        """``approx``: the layer type of the first pass (default ``Int8Linear``)."""
        super().__init__()
        self.approx = (approx or Int8Linear)(linear)
        self.weight, self.bias = linear.weight, linear.bias
        self.top = min(top, linear.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.approx(x)
        best = logits.topk(self.top, dim=-1).indices
        exact = (self.weight[best] @ x.unsqueeze(-1)).squeeze(-1)
        return logits.scatter(-1, best, exact if self.bias is None else exact + self.bias[best])

    def dequantized(self) -> torch.Tensor:
        return self.weight


def check_weight_format(weights: str, device: torch.device, dtype: torch.dtype) -> None:
    """Refuse a weight format the device, dtype or torch build cannot run, before anything loads."""
    if weights not in WEIGHT_FORMATS:
        raise WeightFormatError(f"weights {weights!r}: pick one of {', '.join(WEIGHT_FORMATS)}")
    if weights == "native":
        return
    if torch.device(device).type != "cpu" or dtype not in FORMAT_DTYPES[weights]:
        kernel = KERNELS[weights]
        dtypes = " or ".join(str(t).removeprefix("torch.") for t in FORMAT_DTYPES[weights])
        raise WeightFormatError(f"weights {weights!r} runs on the CPU in {dtypes} ({kernel}), not on {device} in "
                                f"{str(dtype).removeprefix('torch.')}: use --weights native there")
    if weights == "int4" and not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
        raise WeightFormatError(f"weights 'int4' needs torch's CPU int4 kernel (torch >= 2.6), which torch "
                                f"{torch.__version__} lacks: upgrade torch or use --weights native")
    why = ggml_unavailable() if weights == "ggml" else None
    if why is not None:
        raise WeightFormatError(f"weights 'ggml': {why}; or use --weights int4")


def resolve_weights(weights: str | None, deployed: dict, device: torch.device, dtype: torch.dtype) -> str:
    """The format a run uses: the one named, else the deployed config's (``deployed_compute``) when the run computes
    where it was deployed to (a GPU run of a CPU deployment gets its own default), else ``native``."""
    if weights is not None:
        return weights
    same = (deployed.get("device") == torch.device(device).type
            and deployed.get("dtype") == str(dtype).removeprefix("torch."))
    return deployed.get("weights", "native") if same else "native"


def quantize_linears(hf_model: nn.Module, weights: str) -> nn.Module:
    """The model with its linear layers in ``weights`` (in place; "native" leaves it as loaded)."""
    if weights == "native":
        return hf_model
    if weights == "int8":
        return _dynamic_int8(hf_model)
    fuse, layer = (_fuse_ggml, _ggml_layer) if weights == "ggml" else (_fuse, _int4_layer)
    with torch.no_grad():
        for parent in list(hf_model.modules()):
            for packed, names in FUSED_PROJECTIONS.items():
                fuse(parent, packed, names)
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear):
                    setattr(parent, name, layer(child, head=child is getattr(hf_model, "lm_head", None)))
    return hf_model


# projections of one input packed as one int4 layer (``PackedSlice``): attention's q/k/v, the MLP's gate/up
FUSED_PROJECTIONS = {"qkv_packed": ("q_proj", "k_proj", "v_proj"), "gate_up_packed": ("gate_proj", "up_proj")}


def _fuse(parent: nn.Module, packed: str, names: tuple[str, ...]) -> None:
    """Replace ``parent``'s projections ``names`` by slices of one packed layer (``parent.<packed>``), when all are
    linear layers of one input that take the same format (each row keeps its own groups or scale: the weights are
    those packed apart)."""
    layers = _same_input(parent, names, INT8_INPUTS)
    if layers is None:
        return
    grids = [_int4_fit(m) for m in layers]
    if any(g is None for g in grids) and any(g is not None for g in grids):
        for name, m, grid in zip(names, layers, grids):  # some on a 4-bit grid, some not: each its own format
            setattr(parent, name, _packed(m, grid))
        return
    grid = None if grids[0] is None else tuple(torch.cat(parts) for parts in zip(*grids))  # each row keeps its groups
    _slice(parent, packed, names, layers, _packed(_whole(layers), grid))


def _fuse_ggml(parent: nn.Module, packed: str, names: tuple[str, ...]) -> None:
    """``_fuse`` for the ``ggml`` format: the packed layer takes the block type that gives back all of its rows."""
    layers = _same_input(parent, names, GGML_BLOCK)
    if layers is not None:
        _slice(parent, packed, names, layers, GgmlLinear(_whole(layers)))


def _same_input(parent: nn.Module, names: tuple[str, ...], multiple: int) -> list[nn.Linear] | None:
    """``parent``'s projections ``names`` when all are linear layers of one input, a multiple of ``multiple``."""
    layers = [getattr(parent, n, None) for n in names]
    if not all(isinstance(m, nn.Linear) for m in layers) or len({m.in_features for m in layers}) > 1 \
            or layers[0].in_features % multiple:
        return None
    return layers


def _whole(layers: list[nn.Linear]) -> nn.Linear:
    """One linear layer whose outputs are ``layers``' in order (a missing bias is zeros)."""
    whole = torch.nn.utils.skip_init(nn.Linear, layers[0].in_features, sum(m.out_features for m in layers),
                                     bias=any(m.bias is not None for m in layers), device=layers[0].weight.device,
                                     dtype=layers[0].weight.dtype)
    whole.weight.copy_(torch.cat([m.weight for m in layers]))
    if whole.bias is not None:
        whole.bias.copy_(torch.cat([m.weight.new_zeros(m.out_features) if m.bias is None else m.bias for m in layers]))
    return whole


def _slice(parent: nn.Module, packed: str, names: tuple[str, ...], layers: list[nn.Linear], fused: PackedLinear
           ) -> None:
    """``fused`` becomes ``parent.<packed>`` and each projection of ``names`` its slice."""
    setattr(parent, packed, fused)
    start = 0
    for name, m in zip(names, layers):
        setattr(parent, name, PackedSlice(fused, start, start + m.out_features))
        start += m.out_features


def _ggml_layer(linear: nn.Linear, head: bool) -> nn.Module:
    if linear.in_features % GGML_BLOCK:
        return linear  # no block type takes it: left as loaded
    return RescoredHead(linear, approx=GgmlLinear) if head else GgmlLinear(linear)


def _int4_layer(linear: nn.Linear, head: bool) -> nn.Module:
    if linear.in_features % INT8_INPUTS:
        return linear  # neither kernel takes it: left as loaded
    if head:
        return RescoredHead(linear)  # its grid is never looked for
    return _packed(linear, _int4_fit(linear))


def _packed(linear: nn.Linear, grid: tuple[torch.Tensor, ...] | None) -> PackedLinear:
    """Int4 on the layer's 4-bit grid (``_int4_fit``), int8 weight-only without one."""
    return Int8Linear(linear) if grid is None else Int4Linear(linear, grid)


def _int4_fit(linear: nn.Linear) -> tuple[torch.Tensor, ...] | None:
    """The layer's 4-bit grid (``_int4_grid``) when the int4 kernel packs it and its weights lie on it, else None."""
    if linear.out_features % INT4_ROWS or linear.in_features % INT4_GROUP:
        return None
    grid = _int4_grid(linear.weight)
    return grid if _on_grid(linear.weight, *grid) else None


def _int4_grid(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q [out, in / INT4_GROUP, INT4_GROUP] in 0..15, scale, minimum [out, groups, 1]): each group's grid from its
    minimum and its step.  The step is the span over the codes it covers, counted by the smallest gap between two
    of its values: a Q4_1 block spans all 16 codes, a Q4_K sub-block (its scale and minimum rounded to 6 bits) often
    fewer (Gemma 3's o_proj: a fifth of its groups).  Weights on no grid have gaps far below a sixteenth of their
    span, and get the span over 15."""
    groups = weight.detach().float().view(weight.shape[0], -1, INT4_GROUP)
    low, high = groups.amin(dim=-1, keepdim=True), groups.amax(dim=-1, keepdim=True)
    span = high - low
    codes = torch.full_like(span, 15.0)  # the steps a group's span covers

    def on(codes):
        scale = (span / codes).clamp(min=torch.finfo(torch.float32).tiny)
        return torch.round((groups - low) / scale).clamp(0, 15), scale

    q, scale = on(codes)
    # only groups off the span / 15 grid (beyond the weight dtype's rounding) are sorted for their smallest gap
    off = (low + scale * q - groups).abs().amax(dim=-1)
    slack = span[..., 0] * 1e-4 + torch.finfo(weight.dtype).eps * groups.abs().amax(dim=-1)
    short = (off > slack).nonzero(as_tuple=True)
    if len(short[0]):
        gaps = groups[short].sort(dim=-1).values.diff(dim=-1)
        gap = torch.where(gaps > span[short] * 1e-4, gaps, torch.inf).amin(dim=-1, keepdim=True)  # equal values: none
        codes[short] = torch.round(span[short] / gap).clamp(1, 15)
        q, scale = on(codes)
    return q, scale, low


def on_int4_grid(weight: torch.Tensor) -> bool:
    """Whether ``weight`` [out, in] is its own 4-bit grid: found again, within INT4_GRID_ERROR of its norm (or its
    dtype's rounding, ``_on_grid``)."""
    return _on_grid(weight, *_int4_grid(weight))


def _on_grid(weight: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, low: torch.Tensor) -> bool:
    """Within INT4_GRID_ERROR of the weight's norm, or within its dtype's rounding (a bfloat16 model's weights are a
    GGUF's grid rounded to 8 bits: ~0.002 of their norm off it, where a 5-bit grid is 0.08)."""
    groups = weight.detach().float().view(q.shape)
    tolerance = max(INT4_GRID_ERROR, torch.finfo(weight.dtype).eps)
    return bool((low + scale * q - groups).norm() <= tolerance * groups.norm())


def _dynamic_int8(hf_model: nn.Module) -> nn.Module:
    import warnings

    with warnings.catch_warnings():  # torch 2.13 marks torch.ao.quantization deprecated; its kernels still ship
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.filterwarnings("ignore", message=".*quantized tensor creation functions.*")
        try:
            from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic
        except ImportError as exc:
            raise WeightFormatError(f"weights 'int8' needs torch.ao.quantization, which torch {torch.__version__} "
                                    "lacks: use --weights native") from exc
        # a scale per output row: one per tensor cost SmolLM2 1.6x its perplexity
        return quantize_dynamic(hf_model, {nn.Linear: per_channel_dynamic_qconfig}, inplace=True)


def linear_weight(module: nn.Module) -> torch.Tensor:
    """A linear layer's weight as a float tensor, whatever its format (a dynamic int8 layer's is a method)."""
    if isinstance(module, (PackedLinear, PackedSlice, RescoredHead)):
        return module.dequantized()
    weight = module.weight
    return weight().dequantize() if callable(weight) else weight
