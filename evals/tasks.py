"""Synthetic long-context retrieval tasks (RULER-style), as token ids, reproducible from a seed.

Every task plants key->value needles in a haystack of filler tokens and asks for values
through *forced* decode tokens ``QUERY k``: each answer is predicted during decode, so
it depends on what the KV policy lets the model see, never on the full-attention prefill.

    single_needle  one needle, one query
    multikey       8 needles with distinct keys, one query
    multivalue     one key followed by 4 value tokens, plus 7 distractor needles; the 4 are
                   predicted one after another (each one a retrieval)
    multiquery     8 needles, 4 queries
    var_tracking   a chain x1<-v, x2<-x1, x3<-x2, x4<-x3 (in order); querying x4, then x3, x2,
                   x1 walks the chain back to v

Tokens come from a format: ``FixtureFormat`` (the shipped model's 256 ids: specials 0-15,
filler 16-79, keys 80-159, values 160-255; a chained variable's value is its key's *value
form*, key + 80, so a token never plays both roles) or ``TextFormat`` (any tokenizer:
single-token words as keys and values, "The value of K is V." needles in a haystack of
plain sentences).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

PAD, BOS, EOS, QUERY = 0, 1, 2, 3
FILLER = np.arange(16, 80)
KEYS = np.arange(80, 160)
VALUES = np.arange(160, 256)
VOCAB_SIZE = 256
TASKS = ("single_needle", "multikey", "multivalue", "multiquery", "var_tracking")


@dataclass
class TaskInstance:
    """``context`` is the prompt; ``forced`` the decode inputs; predictions at ``answer_at`` must equal ``answers``.

    Predictions are indexed like Engine.generate(teacher_forcing=...) token_ids: index 0 is
    the choice after the prompt, index i the choice after forced[i-1].
    """

    task: str
    context: list[int]
    forced: list[int]
    answer_at: list[int]
    answers: list[int]
    depth: float  # where the first needle sits, 0 = start, 1 = end of the haystack
    needles: list[tuple[int, int]] = field(default_factory=list)  # (position, length) in context

    def training_sequence(self) -> tuple[list[int], list[int]]:
        """Tokens and the positions whose next-token labels are answers (for the loss)."""
        tokens = self.context + self.forced + [self.answers[-1]]
        label_pos = [len(self.context) + i - 1 for i in self.answer_at]
        return tokens, label_pos

    def score(self, predictions: list[int]) -> bool:
        return all(i < len(predictions) and predictions[i] == a for i, a in zip(self.answer_at, self.answers))


class FixtureFormat:
    """The fixture model's token ids: a needle is ``k v...``, a query ``QUERY k``."""

    bos = [BOS]
    keys = KEYS
    values = VALUES
    chain_values = VALUES[VALUES >= 240]  # 160..239 are the value forms of keys

    def needle(self, key: int, values: list[int]) -> list[int]:
        return [key, *values]

    def query(self, key: int) -> list[int]:
        return [QUERY, key]

    def value_form(self, key: int) -> int:
        return key + 80

    def filler(self, rng, n: int) -> list[int]:
        return rng.choice(FILLER, size=n).tolist()


HAYSTACK_TEXT = (
    " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
    " A quiet river runs past the old mill, and the morning light falls on the stones."
    " People walk to the market, talk about the weather, and carry bread home before noon."
)


class TextFormat:
    """Natural-language tasks for any tokenizer: needles " The value of K is V." in plain sentences.

    Keys and values are distinct single-token lowercase words (with a leading space), so a
    value is one token to predict; a chained variable's value is the variable word itself.
    """

    def __init__(self, tokenizer, min_words: int = 64):
        self.tokenizer = tokenizer
        encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
        words = []
        for token_id, piece in enumerate(tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))):
            word = piece[1:] if piece and piece[0] in "\u0120\u2581" else ""  # byte-level "G." or sentencepiece space mark
            if word.isascii() and word.isalpha() and word.islower() and 4 <= len(word) <= 9:
                if encode(" " + word)[-1:] == [token_id]:
                    words.append(token_id)
        haystack_ids = set(encode(HAYSTACK_TEXT))
        words = [w for w in words if w not in haystack_ids]
        if len(words) < 2 * min_words:
            raise ValueError(f"the tokenizer has only {len(words)} single-token words; {2 * min_words} are needed")
        self.keys = np.array(words[0::2])
        self.values = np.array(words[1::2])
        self.chain_values = self.values
        self.bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
        self._prefix = encode(" The value of")
        self._is = encode(" is")
        self._dot = encode(".")
        self._haystack = encode(HAYSTACK_TEXT)

    def needle(self, key: int, values: list[int]) -> list[int]:
        return [*self._prefix, key, *self._is, *values, *self._dot]

    def query(self, key: int) -> list[int]:
        return [*self._prefix, key, *self._is]

    def value_form(self, key: int) -> int:
        return key

    def filler(self, rng, n: int) -> list[int]:
        start = int(rng.integers(len(self._haystack)))
        reps = (start + n) // len(self._haystack) + 1
        return (self._haystack * reps)[start : start + n]


def _queries(fmt, pairs: list[tuple[int, list[int]]]) -> tuple[list[int], list[int], list[int]]:
    """forced tokens, answer indices and answers for querying (key, value tokens) pairs in order."""
    forced, answer_at, answers = [], [], []
    for n, (key, value) in enumerate(pairs):
        forced += fmt.query(key)
        for j, v in enumerate(value):
            answer_at.append(len(forced))
            answers.append(v)
            if j + 1 < len(value) or n + 1 < len(pairs):
                forced.append(v)
    return forced, answer_at, answers


def _plant(fmt, rng, length: int, needles: list[list[int]], ordered: bool, depth: float | None):
    """BOS + filler with the needles inserted; returns (prompt, [(start, length)], depth of needle 0).

    ``ordered`` keeps needle i before needle i+1 (a chain must be read in order);
    ``depth`` pins needle 0 at that relative place in the haystack.
    """
    n_fill = length - len(fmt.bos) - sum(len(n) for n in needles)
    if n_fill < 1:
        raise ValueError(f"context {length} is too short for {len(needles)} needles")
    filler = fmt.filler(rng, n_fill)
    points = rng.integers(0, n_fill + 1, size=len(needles))
    if ordered:
        points = np.sort(points)
    if depth is not None:
        points[0] = round(depth * n_fill)
        if ordered:
            points = np.maximum.accumulate(points)
    order = sorted(range(len(needles)), key=lambda i: (points[i], i))
    prompt, spans, cursor = list(fmt.bos), {}, 0
    for i in order:
        prompt += filler[cursor : points[i]]
        cursor = points[i]
        spans[i] = (len(prompt), len(needles[i]))
        prompt += needles[i]
    prompt += filler[cursor:]
    return prompt, [spans[i] for i in range(len(needles))], spans[0][0] / length


def make_instance(task: str, context: int, rng: np.random.Generator, depth: float | None = None,
                  fmt=None) -> TaskInstance:
    """One instance of ``task`` whose prompt has ``context`` tokens."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; tasks: {TASKS}")
    fmt = fmt or FixtureFormat()
    n_needles = {"single_needle": 1, "multikey": 8, "multivalue": 8, "multiquery": 8, "var_tracking": 4}[task]
    keys = [int(k) for k in rng.choice(fmt.keys, size=n_needles, replace=False)]
    if task == "var_tracking":
        value = int(rng.choice(fmt.chain_values))
        chain = [(keys[0], [value])] + [(keys[i], [fmt.value_form(keys[i - 1])]) for i in range(1, n_needles)]
        needles = [fmt.needle(k, v) for k, v in chain]
        prompt, placed, at = _plant(fmt, rng, context, needles, ordered=True, depth=depth)
        forced, answer_at, answers = _queries(fmt, chain[::-1])
    else:
        width = 4 if task == "multivalue" else 1
        vals = [int(v) for v in rng.choice(fmt.values, size=n_needles * width, replace=False)]
        pairs = [(keys[i], vals[i * width : (i + 1) * width]) for i in range(n_needles)]
        if task == "multivalue":
            pairs = [pairs[0]] + [(k, v[:1]) for k, v in pairs[1:]]
        needles = [fmt.needle(k, v) for k, v in pairs]
        prompt, placed, at = _plant(fmt, rng, context, needles, ordered=False, depth=depth)
        n_asked = 4 if task == "multiquery" else 1
        order = [0] if n_asked == 1 else [int(i) for i in rng.choice(n_needles, size=n_asked, replace=False)]
        forced, answer_at, answers = _queries(fmt, [pairs[i] for i in order])
    return TaskInstance(task, prompt, forced, answer_at, answers, at, placed)


def make_set(tasks, context: int, samples: int, seed: int, fmt=None) -> list[TaskInstance]:
    """``samples`` instances per task; the same seed gives the same instances everywhere."""
    out = []
    for t_index, task in enumerate(tasks):
        rng = np.random.default_rng([seed, context, t_index])
        out += [make_instance(task, context, rng, fmt=fmt) for _ in range(samples)]
    return out
