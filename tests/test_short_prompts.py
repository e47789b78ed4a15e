"""Prompts of any length from one token up: a prompt shorter than a group stores no record (its tokens wait in
the window until the group fills) and decodes as full does, for every registered policy, record format and G.

Lengths 1 … 2G+1 run as one ragged batch, so every row's tail group is a different length; exact records must
give full's greedy tokens, quantized ones stay within their codes' error (tests/test_quant_records.py's bound)."""
import pytest
import torch

from edgekv.runtime import Engine, policies, quant
from tests.conftest import files_under

NEW_TOKENS = 6
EXACT_POLICIES = [name for name in policies.names() if name != policies.reference()]
GROUPED = [spec.name for spec in policies.specs() if spec.group_tokens is None and spec.on_disk]
ONE_TOKEN_GROUPS = [name for name in EXACT_POLICIES if name not in GROUPED]


def prompts_for(G: int) -> list[list[int]]:
    return [[(7 * i + 3 * n) % 90 + 5 for i in range(n)] for n in range(1, 2 * G + 2)]


def config_for(G: int, prompts, **overrides) -> dict:
    """Every group fits M (and hillinfer keeps every token), so a policy that stores the tail right is exact."""
    return {"G": G, "M": 16, "C": 32, "max_context": 128, "max_batch": len(prompts), "sigma": 2,
            "hillinfer": {"importance_rate": 1.0}, **overrides}


def generate(model_dir, kv_path, policy, config, prompts, forced=None):
    with Engine.from_pretrained(model_dir, kv_path=kv_path, config=config, policy=policy, device="cpu") as engine:
        results = engine.generate(prompts, max_new_tokens=NEW_TOKENS, stop_token_ids=[], output_logits=True,
                                  teacher_forcing=forced)
    assert files_under(kv_path) == [], "released sequences must leave no KV files"
    return results


@pytest.fixture(scope="module")
def references(model_dirs, tmp_path_factory):
    """Per G: full's greedy tokens, and full's logits with those tokens forced."""
    out = {}
    for G in (1, 2, 4, 8, 16):
        prompts, kv = prompts_for(G), tmp_path_factory.mktemp(f"kv-full-{G}")
        free = generate(model_dirs["llama"], kv, "full", config_for(G, prompts), prompts)
        forced = [r.token_ids[:-1] for r in free]
        out[G] = free, forced, generate(model_dirs["llama"], kv, "full", config_for(G, prompts), prompts, forced)
    return out


def cases():
    for policy in EXACT_POLICIES:
        for G in ((1, 2, 4, 8, 16) if policy in GROUPED else (1,)):
            yield pytest.param(policy, G, id=f"{policy}-G{G}")


@pytest.mark.parametrize("policy,G", list(cases()))
def test_every_prompt_length_from_one_token_decodes_as_full_with_exact_records(model_dirs, kv_path, references,
                                                                                policy, G):
    prompts = prompts_for(G)
    free, _, _ = references[G]
    results = generate(model_dirs["llama"], kv_path, policy, config_for(G, prompts, kv_record_dtype="fp16"), prompts)
    for prompt, got, ref in zip(prompts, results, free):
        assert got.token_ids == ref.token_ids, (policy, G, len(prompt))
    if policy in GROUPED:  # the longest prompt filled two groups: they were stored and read back
        assert results[-1].stats["kv_bytes_read"] > 0


@pytest.mark.parametrize("record_dtype", ["int8", "int4"])
@pytest.mark.parametrize("policy,G", [(p, G) for p in GROUPED for G in (1, 4, 16)] + [(p, 1) for p in ONE_TOKEN_GROUPS])
def test_every_prompt_length_from_one_token_stays_within_the_codes_error(model_dirs, kv_path, references,
                                                                         policy, G, record_dtype):
    """Quantized records move the logits by at most a few steps of their codes, and a token may differ from full's
    only where full's own two best logits are closer than twice the error seen."""
    prompts = prompts_for(G)
    _, forced, reference = references[G]
    results = generate(model_dirs["llama"], kv_path, policy, config_for(G, prompts, kv_record_dtype=record_dtype),
                       prompts, forced)
    scale = max(float(r.logits.abs().max()) for r in reference)
    bound = 2 * scale / quant.quant_format(record_dtype).levels
    error = max(float((got.logits - ref.logits).abs().max()) for got, ref in zip(results, reference))
    assert error <= bound, (record_dtype, error, bound)
    for prompt, got, ref in zip(prompts, results, reference):
        top2 = ref.logits.topk(2, dim=-1).values
        close = (top2[:, 0] - top2[:, 1]) <= 2 * error
        differs = torch.tensor(got.token_ids) != torch.tensor(ref.token_ids)
        assert not (differs & ~close).any(), (len(prompt), got.token_ids, ref.token_ids)


def test_a_one_token_prompt_alone_matches_full(model_dirs, kv_path):
    """Batch of one, one token, every group format: the smallest request a client can send."""
    config = {"G": 4, "M": 8, "C": 16, "max_context": 64, "max_batch": 1, "sigma": 2}
    reference = generate(model_dirs["llama"], kv_path, "full", config, [[42]])[0]
    for record_dtype in ("fp16", "int8", "int4"):
        got = generate(model_dirs["llama"], kv_path, "kvswap", {**config, "kv_record_dtype": record_dtype}, [[42]])[0]
        assert len(got.token_ids) == NEW_TOKENS
        if record_dtype == "fp16":
            assert got.token_ids == reference.token_ids
        torch.testing.assert_close(got.logits[0], reference.logits[0])  # the first token attends the prompt only


@pytest.fixture(scope="module")
def int4_server(tmp_path_factory):
    """``edgekv serve`` over the deployed local configuration's record format and G (int4 records, G=4)."""
    from tests.conftest import save_chat_model
    from tests.serving import CFG, serving

    model, kv = save_chat_model(tmp_path_factory.mktemp("short") / "m"), tmp_path_factory.mktemp("kv")
    with serving(model, kv, config={**CFG, "kv_record_dtype": "int4", "score_reduce": "softmax"}) as (url, _):
        yield url


@pytest.mark.parametrize("prompt", ["the", "the value", "the value of", [7], [7, 9], [7, 9, 11]])
@pytest.mark.parametrize("stream", [False, True])
def test_a_prompt_shorter_than_a_group_is_served(int4_server, prompt, stream):
    """A client's first request is often one word: served whole, and streamed to its end."""
    from tests.serving import post, sse_events

    body = {"model": "tiny", "prompt": prompt, "max_tokens": 9, "temperature": 0, "stream": stream}
    r = post(int4_server, "/v1/completions", body)
    assert r.status_code == 200, r.text
    if stream:
        events = sse_events(r.text)
        assert events[-1] == "[DONE]" and all('"error"' not in e for e in events)
    else:
        assert r.json()["usage"]["completion_tokens"] == 9


def test_a_one_word_chat_is_served(int4_server):
    from tests.serving import post

    r = post(int4_server, "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                                                   "max_tokens": 6, "temperature": 0})
    assert r.status_code == 200, r.text
