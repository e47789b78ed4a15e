"""The predictor's choices by name: what the config accepts (runtime/config.py) and the selector implements
(runtime/selector.py).  Below both, so the config validates them without importing the selector and the
dependency points one way (selector -> config)."""
from __future__ import annotations

import torch

SELECTOR_NAMES = ("lowrank", "oracle", "random")  # config 'selector'; runtime.selector.SELECTORS builds each
CORRECTIONS = ("guess", "corrected")  # config 'correction': the layer-ahead picks as they are, or rescored at attention
SCORE_REDUCES = ("sum", "softmax")  # how heads' scores make a token's: logits summed (KVSwap), or a softmax vote each
# K_lr formats: torch dtype stored, bits per element, bytes of per-token scale (integer rows carry one bf16 absmax
# scale; int4 packs two elements a byte, low nibble first)
KLR_FORMATS = {"bfloat16": (torch.bfloat16, 16, 0), "float16": (torch.float16, 16, 0),
               "float32": (torch.float32, 32, 0), "int8": (torch.int8, 8, 2), "int4": (torch.uint8, 4, 2)}
