"""Next-token choice: greedy, or temperature / top-k / top-p sampling from a seeded generator."""
from __future__ import annotations

import math

from dataclasses import dataclass

import torch

# Below this temperature a sampled draw is the top token anyway (a logit gap of 1e-3 scales to 100 nats), and
# dividing by it is where float32 stops being exact: such requests take the greedy path, drawing nothing.
MIN_SAMPLED_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self):
        for name in ("temperature", "top_p"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number, got {getattr(self, name)}")
        if self.seed is not None and not 0 <= self.seed < 2**64:
            raise ValueError(f"seed must be in [0, 2**64), got {self.seed}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


class Sampler:
    def __init__(self, params: SamplingParams, device: torch.device):
        self.params = params
        self.greedy = params.temperature < MIN_SAMPLED_TEMPERATURE
        self.generator = None
        if not self.greedy:
            self.generator = torch.Generator(device=device)
            if params.seed is not None:
                self.generator.manual_seed(params.seed)
            else:
                self.generator.seed()

    def state(self) -> torch.Tensor | None:
        """Where the generator stands (None when greedy): ``restore`` replays the same draws."""
        return None if self.generator is None else self.generator.get_state()

    def restore(self, state: torch.Tensor | None) -> None:
        if state is not None:
            self.generator.set_state(state)

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [B, V] (float32) -> token ids [B].  Logits are shifted to a maximum of 0 before they are scaled,
        so no accepted temperature overflows them."""
        p = self.params
        if self.greedy:
            return logits.argmax(dim=-1)
        logits = (logits - logits.amax(dim=-1, keepdim=True)) / p.temperature
        if p.top_k:
            kth = logits.topk(min(p.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            probs = sorted_logits.softmax(dim=-1)
            # drop a token when the mass before it already reaches top_p (the top token always stays)
            drop = probs.cumsum(dim=-1) - probs >= p.top_p
            drop[:, 0] = False  # even where top_p rounds to 0 in float32 (1e-300)
            logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
        probs = logits.softmax(dim=-1)
        return torch.multinomial(probs, 1, generator=self.generator)[:, 0]
