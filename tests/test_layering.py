"""The layering, read from the source's imports (ast): ``runtime`` imports nothing of install, platforms, evals,
serve or the CLI; install, platforms, evals and serve never import the CLI (``edgekv/``); ``serve`` uses the
runtime only; no import cycle between any two modules.  An import inside a function counts as one at the top
(it runs when called: a cycle it closes is still a cycle); imports under ``if TYPE_CHECKING:`` (not its ``else:``)
are annotations, not dependencies."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"runtime": "edgekv.runtime", "platforms": "edgekv.platforms", "install": "edgekv.install",
            "evals": "edgekv.evals", "serve": "edgekv.serve", "edgekv": "edgekv"}
LAYERS = ("edgekv.runtime", "edgekv.platforms", "edgekv.install", "edgekv.evals", "edgekv.serve")
# what each layer may import besides itself (the CLI, edgekv/, may import every layer)
ALLOWED = {"edgekv.runtime": set(), "edgekv.platforms": {"edgekv.runtime"},
           "edgekv.install": {"edgekv.runtime", "edgekv.platforms"},
           "edgekv.evals": {"edgekv.runtime", "edgekv.install"}, "edgekv.serve": {"edgekv.runtime"}}


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).parts)
    parts[0] = PACKAGES[parts[0]]
    parts[-1] = parts[-1].removesuffix(".py")
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts).replace("edgekv.edgekv", "edgekv")


def modules(root: Path = ROOT) -> dict[str, Path]:
    return {module_name(p, root): p for top in PACKAGES if (root / top).is_dir() for p in (root / top).rglob("*.py")}


def imported(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The project modules ``name`` imports (a package's own submodules named in ``from pkg import sub`` count as
    those submodules, not the package)."""
    tree = ast.parse(path.read_text())
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                   and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING"
                   for statement in node.body for n in ast.walk(statement)}
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
            subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in known]
            found.update(subs)
            if len(subs) < len(node.names):
                found.add(base)
    out = set()
    for target in found:
        while target and target not in known:
            target = target.rpartition(".")[0]
        if target and target != name:
            out.add(target)
    return out


def graph(root: Path = ROOT) -> dict[str, set[str]]:
    known = modules(root)
    return {name: imported(name, path, known) for name, path in known.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], [0]
    for start in edges:
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def layer(module: str) -> str:
    return next((top for top in LAYERS if module == top or module.startswith(top + ".")), "edgekv")


def violations(edges: dict[str, set[str]]) -> list[str]:
    return [f"{source} -> {target}" for source, targets in sorted(edges.items()) for target in sorted(targets)
            if layer(source) != "edgekv" and layer(target) != layer(source)
            and layer(target) not in ALLOWED[layer(source)]]


def test_no_module_import_cycle():
    assert cycles(graph()) == []


def test_every_layer_imports_only_what_it_may():
    assert violations(graph()) == []


@pytest.mark.parametrize("files, cycle, violation", [
    ({"runtime/a.py": "from . import b\n", "runtime/b.py": "from .a import x\n"},
     [["edgekv.runtime.a", "edgekv.runtime.b"]], []),
    ({"runtime/a.py": "from edgekv.serve import app\n", "serve/app.py": "import edgekv.runtime.a\n"},
     [["edgekv.runtime.a", "edgekv.serve.app"]], ["edgekv.runtime.a -> edgekv.serve.app"]),
    ({"evals/x.py": "from edgekv.cli import main\n", "edgekv/cli.py": "from edgekv.evals import x\n"},
     [["edgekv.cli", "edgekv.evals.x"]], ["edgekv.evals.x -> edgekv.cli"]),
    ({"runtime/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import B\n",
      "runtime/b.py": "from .a import x\n"}, [], []),
    ({"runtime/a.py": "def f():\n    from . import b\n", "runtime/b.py": "from .a import x\n"},
     [["edgekv.runtime.a", "edgekv.runtime.b"]], []),
    ({"runtime/a.py": "import typing\nif typing.TYPE_CHECKING:\n    pass\nelse:\n    from .b import B\n",
      "runtime/b.py": "from .a import x\n"}, [["edgekv.runtime.a", "edgekv.runtime.b"]], []),
])
def test_the_checks_catch_a_cycle_and_a_layer_violation(tmp_path, files, cycle, violation):
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    edges = graph(tmp_path)
    assert cycles(edges) == cycle and violations(edges) == violation
