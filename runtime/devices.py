"""Which device and dtype a run computes in, decided once: what the caller names, else the deployed config's,
else ``$EDGEKV_DEVICE``, else the GPU when torch sees one.

The dtype: what the caller names, else the deployed config's (the dtype the install step measured) when the run
is on that device, else float32 on the CPU and, on a GPU, bfloat16 where the GPU computes it natively (Ampere
and newer; ``is_bf16_supported(including_emulation=False)``), float16 elsewhere: emulated bf16 is slow and has
no flash attention.
"""
from __future__ import annotations

import contextlib
import os

import torch

from .config import ConfigError

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
DEVICE_ENV = "EDGEKV_DEVICE"  # e.g. cpu: what runs when nothing names a device (the tests set it)


class DeviceUnavailable(OSError):
    """The device a run or a profile needs is not usable here; the message names the fix."""


def resolve_device(device: str | torch.device | None = None, deployed: str | None = None) -> torch.device:
    """The device to run on; a CUDA device asked for on a torch without CUDA is refused naming the fix."""
    chosen = device or os.environ.get(DEVICE_ENV) or deployed or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(chosen)
    except (RuntimeError, TypeError) as exc:
        raise ConfigError(f"device {chosen!r} is not a torch device (cpu, cuda, cuda:1); pass one of those") from exc
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise DeviceUnavailable(f"device {chosen!r} asked for, but this torch ({torch.__version__}) sees no CUDA GPU: "
                          f"{cuda_fix()}; or run on the CPU (--device cpu)")
    return resolved


def resolve_dtype(device: torch.device, dtype: str | torch.dtype | None = None, deployed: str | None = None,
                  deployed_device: str | None = None) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is not None:
        if dtype not in DTYPES:
            raise ConfigError(f"dtype {dtype!r} is not one of {sorted(DTYPES)}")
        return DTYPES[dtype]
    if deployed in DTYPES and (deployed_device or "cuda").split(":")[0] == device.type:
        return DTYPES[deployed]
    return default_dtype(device)


def resolve_compute(device: str | torch.device | None = None, dtype: str | torch.dtype | None = None,
                    model_dir=None) -> tuple[torch.device, torch.dtype]:
    """(device, dtype) of a run given no deployed config: what is named, else $EDGEKV_DEVICE or the GPU, and
    that device's default dtype (bf16 for synthetic weights in ``model_dir``)."""
    from .synth import synthetic_dtype

    resolved = resolve_device(device)
    return resolved, resolve_dtype(resolved, dtype or (synthetic_dtype(model_dir) if model_dir else None))


def default_dtype(device: torch.device) -> torch.dtype:
    if device.type != "cuda":
        return torch.float32
    return torch.bfloat16 if torch.cuda.is_bf16_supported(including_emulation=False) else torch.float16


def cuda_fix() -> str:
    """What to do about a torch without CUDA on this host (a Jetson needs JetPack's build, a PC a CUDA wheel)."""
    if os.path.exists("/etc/nv_tegra_release"):
        return ("install the PyTorch build for this JetPack/L4T release (NVIDIA's Jetson wheels) and create the venv "
                "with --system-site-packages so it is used: make env JETSON=1")
    return ("install a CUDA build of torch for this driver: make clean && make env picks it (install/host.py), or "
            "pip install torch --index-url https://download.pytorch.org/whl/cuXYZ with XYZ at most nvidia-smi's "
            "CUDA Version (e.g. cu128 for 12.8)")


def decode_threads(device: torch.device, asked: int | None, reads_kv: bool, helper_computes: bool = False
                   ) -> int | None:
    """Torch's intra-op threads for a decode step on ``device`` (None: leave torch's setting).  A disk policy's
    reads run on threads of their own beside the step; on the CPU, with torch's team on every core, each parallel
    op waits for the core they hold (measured on 2 cores, SmolLM2 8K, batch 1 / 4: kvswap's step 1.34x / 1.26x faster
    on one thread than on two, full's 1.12x / 1.10x slower), so such a step leaves them one core.  So does a step
    whose linear layers compute on the policy's helper thread (``helper_computes``, weights 'ggml')."""
    if device.type != "cpu":
        return None
    if asked is not None:
        return asked
    return max(1, torch.get_num_threads() - 1) if reads_kv or helper_computes else None


@contextlib.contextmanager
def intra_op_threads(n: int | None):
    """Torch computes on ``n`` threads inside the block (None: as it is), then as before."""
    if n is None or n == torch.get_num_threads():
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
