"""The package's layers, checked on the source: every import points down, modes and tools stay apart, no cycles.

Every module under ``laserlm/`` is parsed with ``ast``; every static import counts, function-local ones too
(``import x``, ``from x import y``, relative imports resolved; ``from pkg import name`` counts as an import of
``pkg.name`` when that is a module, else of ``pkg``; parent packages, which Python always imports first, are not
counted on their own). Layers, bottom first (a module may import its own layer and lower ones):

| rank | layer | modules |
|---|---|---|
| 0 | base | ``laserlm.errors``, ``laserlm.data`` (the data resolver, when present), ``laserlm.cpuinfo`` (what the CPU is) |
| 1 | models | ``laserlm.models.*`` |
| 2 | runtime | ``laserlm.runtime.*`` |
| 3 | modes | ``laserlm.depth.*``, ``laserlm.speculative.*``, ``laserlm.attention.*`` |
| 4 | registry | ``laserlm.mode_table`` (the table of named modes) |
| 5 | api | ``laserlm`` (package root), ``laserlm.api``, ``laserlm.defaults`` (calibrated defaults of bare mode specs) |
| 6 | tool helpers | ``laserlm.cli_common`` (CLI helpers shared by the tools' subcommands and the CLI), ``laserlm.reports`` (report helpers of ``eval`` and ``bench``) |
| 7 | tools | ``laserlm.training.*``, ``laserlm.evaluation.*``, ``laserlm.bench.*``, ``laserlm.profiling.*``, ``laserlm.serve.*``, ``laserlm.export.*`` |
| 8 | reports | ``laserlm.report.*`` (reports that drive several tools, e.g. ``report seeds``) |
| 9 | cli | ``laserlm.cli`` |
| 10 | entry | ``laserlm.__main__`` (``python -m laserlm``) |

Within a layer, packages are siblings and may not import each other (depth, speculative and attention; training,
evaluation and bench), except the edges in :data:`ALLOWED_SIBLING_EDGES`: ``speculative -> depth`` (the
speculative draft can be a calibrated exit head read from a laser file; depth never imports speculative) and
``laserlm -> laserlm.api`` (the package root re-exports the API), ``laserlm.data -> laserlm.errors`` (the data
resolver raises ``DataFileError``), ``laserlm.api -> laserlm.defaults`` (``LaserLM.mode`` resolves bare
``adaptive`` / ``speculative`` specs). What tools shared moved below them: the
configuration syntax (``MODE[@ATTENTION]``) to ``laserlm.mode_table``, report helpers to ``laserlm.reports``. The api sits below the tools because tools drive a
``LaserLM`` (e.g. the lm-eval adapter calls ``laserlm.load``).

On top of the ranks, the module graph must be acyclic: every strongly connected component (Tarjan) has one
module. Package ``__init__`` modules that re-export their submodules are part of that graph like any module.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "laserlm"

LAYERS = [  # (rank, layer name, package prefixes or exact module names)
    (0, "base", ("laserlm.errors", "laserlm.data", "laserlm.cpuinfo")),
    (1, "models", ("laserlm.models",)),
    (2, "runtime", ("laserlm.runtime",)),
    (3, "modes", ("laserlm.depth", "laserlm.speculative", "laserlm.attention")),
    (4, "registry", ("laserlm.mode_table",)),
    (5, "api", ("laserlm", "laserlm.api", "laserlm.defaults")),
    (6, "tool helpers", ("laserlm.cli_common", "laserlm.reports")),
    (7, "tools", ("laserlm.training", "laserlm.evaluation", "laserlm.bench", "laserlm.profiling",
                  "laserlm.serve", "laserlm.export")),
    (8, "reports", ("laserlm.report",)),
    (9, "cli", ("laserlm.cli",)),
    (10, "entry", ("laserlm.__main__",)),
]
# sibling packages of one layer that may import the other (from, to); keep minimal and acyclic
ALLOWED_SIBLING_EDGES = {("laserlm.speculative", "laserlm.depth"), ("laserlm", "laserlm.api"),
                         ("laserlm.data", "laserlm.errors"),  # the data resolver raises DataFileError
                         ("laserlm.api", "laserlm.defaults")}


def module_names(root: Path = ROOT) -> dict[str, Path]:
    """``dotted module name -> file`` of every ``.py`` under ``root`` (``pkg/__init__.py`` is ``pkg``)."""
    out = {}
    for f in sorted(root.rglob("*.py")):
        parts = list(f.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = f
    return out


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """laserlm modules that module ``name`` (file ``path``) imports anywhere in its body."""
    is_pkg = path.name == "__init__.py"
    package = name if is_pkg else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            # `from pkg import sub` imports module pkg.sub; `from mod import name` imports mod
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in known else mod for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:  # `import laserlm.models.quant` -> the deepest known module
                t = t.rpartition(".")[0]
            if t and t.startswith("laserlm") and t != name:
                found.add(t)
    return found


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    mods = module_names(root)
    return {m: imports_of(m, f, set(mods)) for m, f in mods.items()}


def layer_of(module: str) -> tuple[int, str, str]:
    """``(rank, layer name, package)`` of a module; the package is the longest matching prefix."""
    best = None
    for rank, layer, prefixes in LAYERS:
        for p in prefixes:
            if module == p or (p != "laserlm" and module.startswith(p + ".")):
                if best is None or len(p) > len(best[2]):
                    best = (rank, layer, p)
    if best is None:
        raise AssertionError(f"module {module} has no layer in tests/test_import_graph.py; add it to LAYERS")
    return best


def violations(graph: dict[str, set[str]]) -> list[str]:
    """Upward imports and sibling imports not in :data:`ALLOWED_SIBLING_EDGES`, one line each."""
    out = []
    for src, targets in sorted(graph.items()):
        r1, l1, p1 = layer_of(src)
        for dst in sorted(targets):
            r2, l2, p2 = layer_of(dst)
            if r2 > r1:
                out.append(f"upward import: {src} ({l1}) -> {dst} ({l2})")
            elif r2 == r1 and p1 != p2 and (p1, p2) not in ALLOWED_SIBLING_EDGES:
                out.append(f"sibling import: {src} ({p1}) -> {dst} ({p2}); {l1} packages do not import each other")
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, comps = {}, {}, set(), [], []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, it = work[-1]
            nxt = next(it, None)
            if nxt is not None:
                if nxt not in graph:
                    continue
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    comp.append(m)
                    if m == node:
                        break
                if len(comp) > 1:
                    comps.append(sorted(comp))
    return comps


def test_every_import_points_down_and_modes_and_tools_stay_apart():
    graph = import_graph()
    assert "laserlm.runtime.engine" in graph and "laserlm.mode_table" in graph  # the walk found the package
    found = violations(graph)
    assert not found, "layering violations:\n" + "\n".join(found)


def test_the_module_graph_has_no_cycles():
    comps = cycles(import_graph())
    assert not comps, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in comps)


def test_the_checker_catches_upward_imports_local_imports_and_cycles(tmp_path):
    """The checks fail on a package with the faults they look for (so a clean result means something)."""
    pkg = tmp_path / "laserlm"
    for sub in ("models", "runtime", "depth", "speculative", "training", "evaluation"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "errors.py").write_text("")
    (pkg / "runtime" / "engine.py").write_text("from ..models import loader\n")
    (pkg / "models" / "loader.py").write_text("def f():\n    from ..runtime import engine  # function-local\n")
    (pkg / "speculative" / "draft.py").write_text("from laserlm.depth import heads\n")  # allowed edge
    (pkg / "depth" / "heads.py").write_text("import laserlm.speculative.draft\n")  # mode -> mode, not allowed
    (pkg / "training" / "run.py").write_text("from ..evaluation import score\n")  # tool -> tool
    (pkg / "evaluation" / "score.py").write_text("from .. import errors\n")
    graph = import_graph(pkg)
    assert graph["laserlm.models.loader"] == {"laserlm.runtime.engine"}
    found = violations(graph)
    assert "upward import: laserlm.models.loader (models) -> laserlm.runtime.engine (runtime)" in found
    assert any(v.startswith("sibling import: laserlm.depth.heads") for v in found)
    assert any(v.startswith("sibling import: laserlm.training.run") for v in found)
    assert not any("laserlm.speculative.draft ->" in v for v in found)
    assert ["laserlm.models.loader", "laserlm.runtime.engine"] in cycles(graph)
    assert ["laserlm.depth.heads", "laserlm.speculative.draft"] in cycles(graph)
    with pytest.raises(AssertionError, match="has no layer"):
        layer_of("laserlm.unlayered.http")
