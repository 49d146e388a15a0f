"""The package's shape: no import cycles, the boundaries of docs/architecture.md, formatting.

The import graph counts every `import` statement of a module, the ones inside functions too
(a lazy import still ties two modules together), resolved to modules of `dspark_ds`.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "dspark_ds"


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """The dspark_ds modules `path` imports (a package import counts as its __init__)."""
    tree = ast.parse(path.read_text())
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            candidates = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                base = f"{base}.{node.module}" if node.module else base
            subs = [f"{base}.{a.name}" for a in node.names]
            # `from pkg import sub` imports the submodule; any other name needs pkg itself
            candidates = [c for c in subs if c in modules]
            if len(candidates) < len(subs):
                candidates.append(base)
        else:
            continue
        for cand in candidates:
            # the longest known module that the dotted name starts with
            while cand and cand not in modules:
                cand = cand.rpartition(".")[0]
            # a parent package is always imported before its modules: not an edge
            if cand and cand != name and not name.startswith(cand + "."):
                found.add(cand)
    return found


def import_graph() -> dict[str, set[str]]:
    files = sorted(PACKAGE.rglob("*.py"))
    modules = {module_name(f) for f in files}
    return {module_name(f): imports_of(f, modules) for f in files}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10_000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _external_imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
    return names


def test_no_import_cycles():
    graph = import_graph()
    assert cycles(graph) == []


def test_a_cycle_is_found():
    # the detector itself: a -> b -> c -> a is reported, d -> a is not part of it
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]


def test_cli_is_a_leaf():
    graph = import_graph()
    users = sorted(m for m, deps in graph.items() if "dspark_ds.cli" in deps)
    # only launchers run the CLI in-process: the srun entry point and the demo's forked ranks
    assert users == ["dspark_ds.demo.launcher", "dspark_ds.launch"]


def test_drafters_do_not_depend_on_the_perf_tools():
    graph = import_graph()
    drafters = {m for m in graph if m.startswith("dspark_ds.drafters")}
    assert "dspark_ds.drafters.perf" in drafters  # the `perf` section lives with the drafters
    used = sorted({d for m in drafters for d in graph[m] if d.startswith("dspark_ds.perf")})
    assert used == []


ARCHITECTURE = (
    "drafters/common",
    "drafters/dspark/model.py",
    "drafters/dspark/qwen3.py",
    "drafters/dspark/gemma4.py",
    "drafters/dspark/markov.py",
    "drafters/eagle3/model.py",
    "drafters/eagle3/qwen3.py",
    "drafters/eagle3/gemma4.py",
    "drafters/io.py",
    "drafters/presets.py",
)


@pytest.mark.parametrize("where", ARCHITECTURE)
def test_architecture_files_are_pure_torch(where):
    paths = [PACKAGE / where] if where.endswith(".py") else sorted((PACKAGE / where).glob("*.py"))
    for path in paths:
        bad = {
            n
            for n in _external_imports(path)
            if n.split(".")[0] in ("deepspeed", "mlflow")
            or n.startswith("torch.distributed")
            or n == "dspark_ds.distributed"
        }
        assert not bad, f"{path.relative_to(REPO)} imports {sorted(bad)}"


@pytest.mark.parametrize(
    "lib,allowed", [("deepspeed", ("dspark_ds/engine/",)), ("mlflow", ("dspark_ds/tracking/",))]
)
def test_one_importer_per_backend(lib, allowed):
    users = sorted(
        str(p.relative_to(REPO))
        for p in PACKAGE.rglob("*.py")
        if any(n.split(".")[0] == lib for n in _external_imports(p))
    )
    assert users and all(u.startswith(allowed) for u in users), users


@pytest.mark.parametrize("args", [["format", "--check"], ["check"]], ids=["format", "lint"])
def test_ruff(args):
    # ruff comes with the [dev] extra (tools/install.sh)
    proc = subprocess.run(
        [sys.executable, "-m", "ruff", *args, "dspark_ds", "tests"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def deepspeed_imports_before_the_guard(path: Path) -> list[str]:
    """Where `path` imports deepspeed other than through `runtime.import_deepspeed()`: at the
    module's own import, or in a function before that function calls `import_deepspeed()`."""

    def imports_deepspeed(node) -> bool:
        if isinstance(node, ast.Import):
            return any(a.name.split(".")[0] == "deepspeed" for a in node.names)
        return isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == (
            "deepspeed"
        )

    tree = ast.parse(path.read_text())
    functions = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
    inside = {id(n) for f in functions for n in ast.walk(f)}
    bad = [
        f"line {n.lineno}" for n in ast.walk(tree) if imports_deepspeed(n) and id(n) not in inside
    ]
    for f in functions:
        if f.name == "import_deepspeed":
            continue
        guards = [
            n.lineno
            for n in ast.walk(f)
            if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "import_deepspeed"
        ]
        bad += [
            f"line {n.lineno} ({f.name})"
            for n in ast.walk(f)
            if imports_deepspeed(n) and not any(g < n.lineno for g in guards)
        ]
    return bad


def test_the_engine_imports_deepspeed_on_first_use_through_its_guard():
    # importing a part of the engine never imports deepspeed, and deepspeed's first import
    # always keeps MLflow out (engine/runtime.py)
    bad = {
        str(p.relative_to(REPO)): found
        for p in sorted((PACKAGE / "engine").glob("*.py"))
        if (found := deepspeed_imports_before_the_guard(p))
    }
    assert bad == {}


def test_an_unguarded_deepspeed_import_is_found(tmp_path):
    path = tmp_path / "part.py"
    path.write_text(
        "import deepspeed\n\n"
        "def ok():\n    import_deepspeed()\n    from deepspeed.utils import x\n\n"
        "def unguarded():\n    from deepspeed.utils import y\n"
    )
    assert deepspeed_imports_before_the_guard(path) == ["line 1", "line 8 (unguarded)"]
