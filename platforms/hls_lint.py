"""A synthesis-readiness lint for our HLS kernels, run in the tests (no Vitis needed).

Rules: no dynamic allocation, no recursion, every for-loop bounded by a literal or an
UPPER_CASE macro (early exits use ``break``), and every pointer argument of an
``extern "C"`` top function named by an ``#pragma HLS INTERFACE ... port=<arg>``.
"""
from __future__ import annotations

import re
from pathlib import Path

ALLOC = re.compile(r"\b(malloc|calloc|realloc|free)\s*\(|\bnew\b|\bdelete\b")
FUNC = re.compile(r"^(?:static[ \t]+|inline[ \t]+)*[\w:<>]+[ \t\*&]+(?!(?:for|if|while|switch)\b)(\w+)\s*\(([^)]*)\)\s*\{", re.M)
FOR = re.compile(r"\bfor\s*\(([^;]*);([^;]*);")
STATIC_BOUND = re.compile(r"^\s*\w+\s*(<|<=|>|>=)\s*([A-Z_][A-Z0-9_]*|\d+)\s*$|^\s*([A-Z_][A-Z0-9_]*|\d+)\s*(<|<=|>|>=)\s*\w+\s*$")


def _strip_comments(src: str) -> str:
    src = re.sub(r"/\*.*?\*/", "", src, flags=re.S)
    return re.sub(r"//[^\n]*", "", src)


def _body(src: str, open_brace: int) -> str:
    depth = 0
    for i in range(open_brace, len(src)):
        depth += {"{": 1, "}": -1}.get(src[i], 0)
        if depth == 0:
            return src[open_brace : i + 1]
    return src[open_brace:]


def synthesis_only_removed(src: str) -> str:
    """Drop ``#ifndef __SYNTHESIS__`` ... ``#else``/``#endif`` branches: what v++ never sees."""
    out, skip = [], []
    for line in src.splitlines():
        s = line.strip()
        if s.startswith("#ifndef __SYNTHESIS__"):
            skip.append(True)
            continue
        if skip and s.startswith("#else"):
            skip[-1] = not skip[-1]
            continue
        if skip and s.startswith("#endif"):
            skip.pop()
            continue
        if not any(skip):
            out.append(line)
    return "\n".join(out)


def lint(source: str) -> list[str]:
    """Problems found in one kernel source (empty: ready for synthesis by these rules)."""
    src = _strip_comments(synthesis_only_removed(source))
    problems = [f"dynamic allocation: {m.group(0).strip()}" for m in ALLOC.finditer(src)]
    for m in FUNC.finditer(src):
        name, body = m.group(1), _body(src, m.end() - 1)
        if re.search(rf"\b{name}\s*\(", body[1:]):
            problems.append(f"recursion: {name} calls itself")
    for m in FOR.finditer(src):
        if not STATIC_BOUND.match(m.group(2)):
            problems.append(f"loop bound is not static: for ({m.group(1).strip()}; {m.group(2).strip()}; ...)")
    for top in re.finditer(r'extern\s+"C"\s*\{(.*)\}', src, re.S):
        for f in FUNC.finditer(top.group(1)):
            body = _body(top.group(1), f.end() - 1)
            for arg in f.group(2).split(","):
                if "*" in arg:
                    name = arg.replace("*", " ").split()[-1]
                    if not re.search(rf"#pragma\s+HLS\s+INTERFACE\s+\w+\s+port\s*=\s*{name}\b", body):
                        problems.append(f"pointer argument '{name}' of {f.group(1)} has no interface pragma")
    return problems


def lint_file(path: str | Path) -> list[str]:
    return lint(Path(path).read_text())
