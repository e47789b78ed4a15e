"""A synthesis-readiness lint for our HLS kernels, run in the tests (no Vitis needed).

It reads the source as v++ sees it (``__SYNTHESIS__`` defined, the Vitis headers present) and
checks rules from the Vitis HLS user guide (UG1399) that a C++ compiler does not:

- no dynamic allocation, no recursion; every pointer argument of an ``extern "C"`` top function
  named by an ``#pragma HLS INTERFACE ... port=<arg>``;
- every for-loop bounded by a literal / UPPER_CASE constant expression, or carrying a
  ``LOOP_TRIPCOUNT`` pragma when its trip count is computed;
- a ``DATAFLOW`` region is canonical: no conditionally executed statement (if, switch, ?:), no
  break/return/continue, every pointer / reference argument handed to one process only, every
  local channel (stream, array) to at most two (one producer, one consumer);
- no ``break`` (or ``return``) out of a loop that is pipelined, sits inside a pipelined loop,
  encloses one, or belongs to a dataflow process or to a function inlined into a pipelined loop;
- no pipelined loop at II=1 accumulating into a float/double scalar declared outside it (a
  loop-carried floating-point dependency: the adder's latency sets the II).

It is pattern matching on one file, not a C++ front end: fpga/README.md says what it cannot see.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

ALLOC = re.compile(r"\b(malloc|calloc|realloc|free)\s*\(|\bnew\b|\bdelete\b")
FUNC = re.compile(r"^(?:static[ \t]+|inline[ \t]+)*[\w:<>]+[ \t\*&]+(?!(?:for|if|while|switch)\b)(\w+)\s*\(([^)]*)\)\s*\{", re.M)
_CONST = r"(?:[A-Z_][A-Z0-9_]*|\d+)"
_CONST_EXPR = rf"\(?\s*{_CONST}(?:\s*[-+*/]\s*{_CONST})*\s*\)?"
STATIC_BOUND = re.compile(rf"^\s*\w+\s*(?:<|<=|>|>=)\s*{_CONST_EXPR}\s*$|^\s*{_CONST_EXPR}\s*(?:<|<=|>|>=)\s*\w+\s*$")
PRAGMA = re.compile(r"#\s*pragma\s+HLS\s+(\w+)([^\n]*)", re.I)
KEYWORDS = {"if", "for", "while", "switch", "return", "sizeof", "defined"}


def _strip_comments(src: str) -> str:
    """Comments out, line breaks kept, so positions still map to the file's lines."""
    src = re.sub(r"/\*.*?\*/", lambda m: "\n" * m.group(0).count("\n"), src, flags=re.S)
    return re.sub(r"//[^\n]*", "", src)


def _pp_value(expr: str, macros: dict[str, str]) -> bool:
    """Value of an #if expression for v++: __SYNTHESIS__ defined, every __has_include true."""
    expr = re.sub(r"__has_include\s*\(\s*[<\"][^>\"]*[>\"]\s*\)", " 1 ", expr)
    expr = re.sub(r"defined\s*\(\s*(\w+)\s*\)|defined\s+(\w+)",
                  lambda m: " 1 " if (m.group(1) or m.group(2)) in macros else " 0 ", expr)
    expr = re.sub(r"\b[A-Za-z_]\w*", lambda m: f" {macros.get(m.group(0)) or 0} ", expr)
    expr = re.sub(r"!(?!=)", " not ", expr.replace("&&", " and ").replace("||", " or "))
    if not re.fullmatch(r"(?:\s|\d+|and|or|not|[()+\-*/%<>=!])*", expr):
        return True  # an expression this cannot read (a macro with a body): keep the branch, lint it
    try:
        return bool(eval(expr, {"__builtins__": {}}))  # only numbers, operators and parentheses
    except (SyntaxError, ZeroDivisionError):
        return True


def synthesis_view(src: str) -> str:
    """The source with the preprocessor branches v++ does not compile blanked (line breaks kept)."""
    macros = {"__SYNTHESIS__": "1", "__has_include": "1", "__cplusplus": "201703"}
    out, stack = [], []  # per open #if: (this branch is compiled, an earlier branch was)
    for line in src.splitlines():
        active = all(taken for taken, _ in stack)
        m = re.match(r"\s*#\s*(ifdef|ifndef|if|elif|else|endif|define|undef)\b\s*(.*)", line)
        kind, rest = (m.group(1), m.group(2).strip()) if m else ("", "")
        name = rest.split()[0] if rest else ""
        if kind in ("ifdef", "ifndef", "if"):
            value = {"ifdef": name in macros, "ifndef": name not in macros}.get(kind)
            value = _pp_value(rest, macros) if value is None else value
            stack.append((value, value))
        elif kind == "elif" and stack:
            _, done = stack.pop()
            value = not done and _pp_value(rest, macros)
            stack.append((value, done or value))
        elif kind == "else" and stack:
            _, done = stack.pop()
            stack.append((not done, True))
        elif kind == "endif" and stack:
            stack.pop()
        elif kind == "define" and active and "(" not in name:
            macros[name] = rest[len(name):].strip() or "1"
        elif kind == "undef" and active:
            macros.pop(name, None)
        out.append(line if active and not kind else "")
    return "\n".join(out)


synthesis_only_removed = synthesis_view  # the earlier name


def _match(src: str, i: int, open_: str, close: str) -> int:
    """Index of the bracket closing the one at ``i``."""
    depth = 0
    for j in range(i, len(src)):
        depth += (src[j] == open_) - (src[j] == close)
        if depth == 0:
            return j
    return len(src) - 1


def _statement_end(src: str, i: int) -> int:
    """End (inclusive) of the statement starting at or after ``i``."""
    while i < len(src) and src[i].isspace():
        i += 1
    if i < len(src) and src[i] == "{":
        return _match(src, i, "{", "}")
    m = re.match(r"(for|while|if)\s*\(", src[i:])
    if m:
        return _statement_end(src, _match(src, i + m.end() - 1, "(", ")") + 1)
    j = src.find(";", i)
    return j if j >= 0 else len(src) - 1


def _line(src: str, pos: int) -> int:
    return src.count("\n", 0, pos) + 1


@dataclass
class _Loop:
    start: int
    cond: str
    body: tuple[int, int]  # [start, end] of the body, braces included
    pragmas: list[tuple[str, str]] = field(default_factory=list)

    @property
    def pipeline_ii(self) -> int | None:
        for name, args in self.pragmas:
            if name.upper() == "PIPELINE" and not re.search(r"\boff\b", args, re.I):
                m = re.search(r"\bII\s*=\s*(\d+)", args, re.I)
                return int(m.group(1)) if m else 1
        return None

    def holds(self, pos: int) -> bool:
        return self.body[0] <= pos <= self.body[1]


@dataclass
class _Function:
    name: str
    params: str
    body: tuple[int, int]


def _functions(src: str) -> list[_Function]:
    return [_Function(m.group(1), m.group(2), (m.end() - 1, _match(src, m.end() - 1, "{", "}"))) for m in FUNC.finditer(src)]


def _loops(src: str) -> list[_Loop]:
    loops = []
    for m in re.finditer(r"\bfor\s*\(", src):
        close = _match(src, m.end() - 1, "(", ")")
        clauses = src[m.end() : close].split(";")
        body_start = close + 1
        while body_start < len(src) and src[body_start].isspace():
            body_start += 1
        loops.append(_Loop(m.start(), clauses[1] if len(clauses) > 2 else "", (body_start, _statement_end(src, body_start))))
    for p in PRAGMA.finditer(src):  # a pragma belongs to the innermost loop around it
        around = [lp for lp in loops if lp.holds(p.start())]
        if around:
            max(around, key=lambda lp: lp.start).pragmas.append((p.group(1), p.group(2)))
    return loops


def _calls(text: str, names: set[str]) -> list[tuple[int, str, str]]:
    """(offset, name, argument text) of each call to one of ``names`` in ``text``."""
    out = []
    for m in re.finditer(r"\b(\w+)\s*\(", text):
        if m.group(1) in names and m.group(1) not in KEYWORDS:
            close = _match(text, m.end() - 1, "(", ")")
            out.append((m.start(), m.group(1), text[m.end() : close]))
    return out


def _non_scalar_params(params: str) -> list[str]:
    names = []
    for p in params.split(","):
        m = re.search(r"(\w+)\s*(?:\[[^\]]*\]\s*)*$", p.strip())
        if m and (re.search(r"[*&\[]|\bstream\s*<", p)):
            names.append(m.group(1))
    return names


def _dataflow_problems(src: str, funcs: list[_Function], loops: list[_Loop]) -> tuple[list[str], set[str]]:
    problems, processes = [], set()
    names = {f.name for f in funcs}
    for p in PRAGMA.finditer(src):
        if p.group(1).upper() != "DATAFLOW":
            continue
        owner = next((f for f in funcs if f.body[0] <= p.start() <= f.body[1]), None)
        if owner is None:
            continue
        around = [lp for lp in loops if lp.holds(p.start()) and owner.body[0] <= lp.start <= owner.body[1]]
        span = max(around, key=lambda lp: lp.start).body if around else owner.body
        region = src[span[0] : span[1] + 1]
        where = f"the dataflow region of {owner.name} (line {_line(src, p.start())})"
        code = re.sub(r"#[^\n]*", "", region)  # pragmas out: their '=' and names are not code
        calls = _calls(code, names - {owner.name})
        processes |= {name for _, name, _ in calls}
        for m in re.finditer(r"\b(if|switch)\s*\(|\?", code):
            end = _statement_end(code, m.start()) if m.group(0) != "?" else code.find(";", m.start())
            start = m.start() if m.group(0) != "?" else max(code.rfind(c, 0, m.start()) for c in ";{}")
            inside = [name for off, name, _ in calls if start <= off <= end]
            what = f"a process call ({', '.join(inside)}) under a condition" if inside else "a conditional statement"
            problems.append(f"{what} in {where}: '{code[m.start():m.start() + 40].split(chr(10))[0].strip()}'")
        for m in re.finditer(r"\b(break|return|continue)\b", code):
            problems.append(f"'{m.group(1)}' in {where}")
        shared = [(name, 1, "argument") for name in _non_scalar_params(owner.params)]
        decls = re.finditer(r"\bstream\s*<[^;]*>\s*(\w+)|\b\w+\s+(\w+)\s*\[", code)
        shared += [(m.group(1) or m.group(2), 2, "channel") for m in decls]
        for name, limit, kind in shared:
            users = [callee for _, callee, args in calls if re.search(rf"\b{name}\b", args)]
            if len(users) > limit:
                problems.append(f"single-producer-consumer violation in {where}: {kind} '{name}' is passed to "
                                f"{len(users)} processes ({', '.join(users)})")
    return problems, processes


def _reachable(roots: set[str], funcs: list[_Function], src: str) -> set[str]:
    names, seen, todo = {f.name for f in funcs}, set(), list(roots)
    bodies = {f.name: src[f.body[0] : f.body[1] + 1] for f in funcs}
    while todo:
        name = todo.pop()
        if name in seen or name not in bodies:
            continue
        seen.add(name)
        todo += [callee for _, callee, _ in _calls(bodies[name], names - {name})]
    return seen


def _exit_problems(src: str, funcs: list[_Function], loops: list[_Loop], processes: set[str]) -> list[str]:
    names = {f.name for f in funcs}
    pipelined = [lp for lp in loops if lp.pipeline_ii is not None]
    inlined = set()  # functions called inside a pipelined loop: inlined into it, their loops unrolled
    for lp in pipelined:
        inlined |= {name for _, name, _ in _calls(src[lp.body[0] : lp.body[1] + 1], names)}
    inlined = _reachable(inlined, funcs, src)
    in_process = _reachable(processes, funcs, src)
    problems = []
    for m in re.finditer(r"\b(break|return)\b", src):
        around = [lp for lp in loops if lp.holds(m.start())]
        if not around:
            continue
        loop = max(around, key=lambda lp: lp.start)
        func = next((f for f in funcs if f.body[0] <= m.start() <= f.body[1]), None)
        why = None
        if any(lp.pipeline_ii is not None for lp in around):
            why = "a pipelined loop"
        elif any(loop.holds(p.start) for p in pipelined):
            why = "a loop enclosing a pipelined loop"
        elif func and func.name in inlined:
            why = f"a loop of {func.name}, which a pipelined loop inlines"
        elif func and func.name in in_process:
            why = f"a loop of {func.name}, a dataflow process (loops with multiple exits)"
        if why:
            problems.append(f"'{m.group(1)}' out of {why}: for (...{loop.cond.strip()}...) at line {_line(src, loop.start)}")
    return problems


def _accumulation_problems(src: str, funcs: list[_Function], loops: list[_Loop]) -> list[str]:
    problems = []
    for lp in loops:
        if lp.pipeline_ii != 1:
            continue
        func = next((f for f in funcs if f.body[0] <= lp.start <= f.body[1]), None)
        if func is None:
            continue
        body = src[lp.body[0] : lp.body[1] + 1]
        outside = func.params + "," + src[func.body[0] : lp.start] + src[lp.body[1] + 1 : func.body[1]]
        targets = {m.group(1) for m in re.finditer(r"(?<![\w.>\]])([A-Za-z_]\w*)\s*[-+*/]=", body)}
        targets |= {m.group(1) for m in re.finditer(r"(?<![\w.>\]])([A-Za-z_]\w*)\s*(?<![=<>!])=(?!=)[^;]*?(?<![\w.])\1\b", body)}
        for name in sorted(targets):
            decl = rf"\b(?:float|double)\s*&?\s*(?:\w+\s*(?:=[^,;]*)?,\s*)*{name}\s*(?:[=;,)]|$)"
            if re.search(decl, outside, re.M):
                problems.append(f"loop-carried floating-point dependency: '{name}' accumulates across the iterations "
                                f"of the II=1 pipelined loop at line {_line(src, lp.start)} (use partial sums or a tree)")
    return problems


def lint(source: str) -> list[str]:
    """Problems found in one kernel source (empty: ready for synthesis by these rules)."""
    src = _strip_comments(synthesis_view(source))
    funcs, loops = _functions(src), _loops(src)
    problems = [f"dynamic allocation: {m.group(0).strip()}" for m in ALLOC.finditer(src)]
    for f in funcs:
        if re.search(rf"\b{f.name}\s*\(", src[f.body[0] + 1 : f.body[1]]):
            problems.append(f"recursion: {f.name} calls itself")
    for lp in loops:
        if not STATIC_BOUND.match(lp.cond) and not any(n.upper() == "LOOP_TRIPCOUNT" for n, _ in lp.pragmas):
            problems.append(f"loop bound is not static and has no LOOP_TRIPCOUNT: for (...; {lp.cond.strip()}; ...) "
                            f"at line {_line(src, lp.start)}")
    for top in re.finditer(r'extern\s+"C"\s*\{(.*)\}', src, re.S):
        for f in FUNC.finditer(top.group(1)):
            body = top.group(1)[f.end() - 1 : _match(top.group(1), f.end() - 1, "{", "}") + 1]
            for arg in f.group(2).split(","):
                if "*" in arg:
                    name = arg.replace("*", " ").split()[-1]
                    if not re.search(rf"#pragma\s+HLS\s+INTERFACE\s+\w+\s+port\s*=\s*{name}\b", body, re.I):
                        problems.append(f"pointer argument '{name}' of {f.group(1)} has no interface pragma")
    dataflow, processes = _dataflow_problems(src, funcs, loops)
    problems += dataflow
    problems += _exit_problems(src, funcs, loops, processes)
    problems += _accumulation_problems(src, funcs, loops)
    return problems


def lint_file(path: str | Path) -> list[str]:
    return lint(Path(path).read_text())
