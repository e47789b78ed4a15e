"""A policy is one module plus one registry line: a toy policy defined here alone runs through generate, the
memory plan, a bench row and an eval row, and the rest of the code asks the registry, never a policy's name."""
import ast
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from edgekv.runtime import Engine, policies
from edgekv.runtime.config import RuntimeConfig
from edgekv.runtime.forward import decode_attention
from edgekv.runtime.kv_policy import KVPolicy
from edgekv.runtime.memory import plan_memory
from edgekv.runtime.model import ModelDims

ROOT = Path(__file__).resolve().parents[1]


class RecentKV(KVPolicy):
    """The newest ``capacity`` tokens of each sequence in a ring (keys carry their RoPE: order is free)."""

    def __init__(self, model, batch: int, capacity: int):
        super().__init__(model, batch, capacity)
        d = model.dims
        self.capacity = capacity
        self.kv = torch.zeros(d.n_layers, 2, batch, d.n_kv_heads, capacity, d.head_dim, dtype=model.dtype)
        self._rows = torch.arange(batch)

    @property
    def resident_bytes(self):
        return self.kv.numel() * self.kv.element_size()

    def store_prompt(self, layer, seq, k, v):
        kept = min(k.shape[1], self.capacity)
        at = torch.arange(k.shape[1] - kept, k.shape[1]) % self.capacity
        self.kv[layer, 0, seq, :, at] = k[:, -kept:]
        self.kv[layer, 1, seq, :, at] = v[:, -kept:]

    def attend(self, layer, q, k, v):
        at = torch.from_numpy(self.lengths % self.capacity)
        self.kv[layer, 0, self._rows, :, at] = k[:, :, 0]
        self.kv[layer, 1, self._rows, :, at] = v[:, :, 0]
        filled = torch.from_numpy(np.minimum(self.lengths + 1, self.capacity))
        mask = (torch.arange(self.capacity) < filled[:, None])[:, None, None, :]
        return decode_attention(self.model, q, self.kv[layer, 0], self.kv[layer, 1], mask)


class Recent(policies.PolicySpec, name="toy-recent", on_disk=False):
    """In memory, sized by the budget: the newest tokens that fit it (StreamingLLM without sinks)."""

    @staticmethod
    def capacity(cfg, dims) -> int:
        token_bytes = dims.n_layers * 2 * dims.n_kv_heads * dims.head_dim * 4
        if cfg.max_kv_mem_mib is None:
            return cfg.max_context
        return max(1, min(cfg.max_context, int(cfg.max_kv_mem_mib * 2**20 / cfg.max_batch // token_bytes)))

    def memory_parts(self, cfg, dims, kv_itemsize, rank, stride_bytes):
        return {"recent": self.capacity(cfg, dims) * dims.n_layers * 2 * dims.n_kv_heads * dims.head_dim * kv_itemsize}

    def build(self, env, batch, cfg):
        return RecentKV(env.model, batch, self.capacity(cfg, env.model.dims))


@pytest.fixture
def toy():
    policies.register("toy-recent", Recent)
    yield policies.get("toy-recent")
    policies.unregister("toy-recent")


def test_a_toy_policy_generates_and_equals_full_while_the_context_fits(model_dirs, kv_path, toy):
    prompt = list(range(3, 60))
    runs = {}
    for policy in ("full", "toy-recent"):
        with Engine.from_pretrained(model_dirs["llama"], kv_path=kv_path, config={"max_context": 128},
                                    policy=policy, device="cpu") as engine:
            runs[policy] = engine.generate([prompt], max_new_tokens=8)[0]
    assert runs["toy-recent"].token_ids == runs["full"].token_ids
    assert runs["toy-recent"].stats["policy"] == "toy-recent" and runs["toy-recent"].stats["kv_bytes_read"] == 0


def test_a_toy_policy_is_sized_and_refused_by_the_memory_plan(model_dirs, kv_path, toy):
    dims = ModelDims(n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, hidden=32, vocab=100)
    cfg = RuntimeConfig.load({"max_context": 1024, "max_batch": 1, "max_kv_mem_mib": 0.25})
    plan = plan_memory("toy-recent", cfg, dims, 4, 1, 512)
    assert plan.per_sequence_bytes == {"recent": 1024 * 2 * 2 * 2 * 8 * 4} and plan.total_bytes <= 0.25 * 2**20
    with pytest.raises(ValueError, match="unknown policy 'toy-recnt'.*toy-recent"):
        Engine.from_pretrained(model_dirs["llama"], kv_path=kv_path, policy="toy-recnt", device="cpu")


def test_a_toy_policy_runs_as_a_bench_row_under_each_budget(model_dirs, tmp_path, toy):
    from edgekv.cli import main

    out = tmp_path / "bench.json"
    assert main(["bench", "--model", model_dirs["llama"], "--batches", "1", "--contexts", "256", "--budgets", "1/4",
                 "--steps", "2", "--warmup", "1", "--disk-seconds", "0.3", "--kv-path", str(tmp_path),
                 "--policies", "full,toy-recent", "--json", str(out)]) == 0
    runs = json.loads(out.read_text())["runs"]
    assert [(r["policy"], r["budget"]) for r in runs] == [("full", None), ("toy-recent", "1/4")]
    assert runs[1]["kv_resident_mib"] <= runs[0]["kv_resident_mib"] / 4 + 1e-9 and runs[1]["G"] is None


def test_a_toy_policy_runs_as_an_eval_row(tmp_path, toy):
    from edgekv.evals import harness
    from edgekv.evals.variants import eval_variants
    from edgekv.runtime.checkpoints import resolve_checkpoint

    variants = eval_variants(["toy-recent"], [0.5], {"G": 4, "score_reduce": "sum"}, "mg_const", ["auto"],
                             ablations=False, tasks=True)
    assert [v.label for v in variants] == ["full", "toy-recent@1/2"]
    results = harness.evaluate(resolve_checkpoint("fixture"), tmp_path, variants, [256], ["single_needle"], 2, 0,
                               quiet=True)
    assert [r.variant for r in results] == ["full", "toy-recent@1/2"]
    assert results[1].config["max_kv_mem_mib"] > 0 and 0 <= results[1].accuracy <= 1


# ---- nothing outside the registry tells policies apart by name -----------------------------------------------

SOURCES = [p for folder in ("runtime", "install", "platforms", "evals", "serve", "edgekv", "bench")
           for p in sorted((ROOT / folder).rglob("*.py"))]


def _name_branches(path: Path, names: set[str]) -> list[str]:
    """Comparisons (==, !=, in, not in) and startswith calls whose operands include a policy's name."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        consts = []
        if isinstance(node, ast.Compare):
            for side in [node.left, *node.comparators]:
                consts += [c.value for c in ast.walk(side) if isinstance(c, ast.Constant) and isinstance(c.value, str)]
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "startswith":
            consts += [c.value for a in node.args for c in ast.walk(a) if isinstance(c, ast.Constant)
                       and isinstance(c.value, str)]
        hits = sorted({c for c in consts if c in names})
        if hits:
            found.append(f"{path}:{node.lineno} {hits}")
    return found


def test_no_module_outside_the_registry_branches_on_a_policy_name():
    names = set(policies.names())
    found = [hit for path in SOURCES if "policies" not in path.parts for hit in _name_branches(path, names)]
    assert found == []


def test_the_name_check_catches_a_branch(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f(policy):\n    return policy == 'kvswap' or policy.startswith(('token', 'x'))\n")
    assert len(_name_branches(bad, {"kvswap", "token"})) == 2
