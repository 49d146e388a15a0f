"""The package's shape: no import cycles, the boundaries of docs/architecture.md, sizes,
formatting.

The import graph counts every `import` statement of a module, the ones inside functions too
(a lazy import still ties two modules together), resolved to modules of `dspark_ds`; not those
under `if TYPE_CHECKING:`, which never run (a type a module only names in its annotations). A
module's import of its own parent package is an edge of the graph `import_graph(parents=True)`
only: the parent is imported first anyway, but its names may not be there yet when the parent
imports the module (a loop through the parent).
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "dspark_ds"


def module_name(path: Path, repo: Path = REPO) -> str:
    parts = path.relative_to(repo).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, modules: set[str], repo: Path = REPO, parents: bool = False) -> set[str]:
    """The modules of `modules` that `path` imports (a package import counts as its __init__;
    its own parent packages only with `parents`)."""
    tree = ast.parse(path.read_text())
    name = module_name(path, repo)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    typing_only = {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING"
        for inner in ast.walk(node)
    }
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
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
            # a parent package is always imported before its modules: an edge with `parents`
            if cand and cand != name and (parents or not name.startswith(cand + ".")):
                found.add(cand)
    return found


def import_graph(package: Path = PACKAGE, parents: bool = False) -> dict[str, set[str]]:
    repo = package.parent
    files = sorted(package.rglob("*.py"))
    modules = {module_name(f, repo) for f in files}
    return {module_name(f, repo): imports_of(f, modules, repo, parents) for f in files}


def reachable(graph: dict[str, set[str]], package: str) -> set[str]:
    """Every module the modules of `package` import, directly or through others."""
    todo = [m for m in graph if m == package or m.startswith(package + ".")]
    seen: set[str] = set()
    while todo:
        for dep in graph[todo.pop()]:
            if dep not in seen:
                seen.add(dep)
                todo.append(dep)
    return seen


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


def test_no_module_imports_its_parent_package_while_the_parent_imports_it():
    # a package's __init__ is its face: its modules import each other, never the package they
    # are in while it imports them (the tuner's stages import the stages, not dspark_ds.tune)
    assert cycles(import_graph(parents=True)) == []


def test_imports_inside_functions_and_of_a_parent_package_are_found(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from pkg.stage import go\n")
    (pkg / "stage.py").write_text("def go():\n    from pkg import helper\n    import pkg.low\n")
    (pkg / "low.py").write_text("X = 1\n")
    assert import_graph(pkg)["pkg.stage"] == {"pkg.low"}
    assert import_graph(pkg, parents=True)["pkg.stage"] == {"pkg", "pkg.low"}
    assert cycles(import_graph(pkg)) == []
    assert cycles(import_graph(pkg, parents=True)) == [["pkg", "pkg.stage"]]


def test_training_never_imports_the_tuner():
    # the tuner drives training through train/timed.py (TimedSteps); the figures both need
    # (inventory, FLOPs, device peaks) are the cost layer's
    graph = import_graph()
    assert "dspark_ds.train.timed" in graph
    up = sorted(d for d in reachable(graph, "dspark_ds.train") if d.startswith("dspark_ds.tune"))
    assert up == []


def test_the_cost_layer_sits_below_training_and_the_tuner():
    graph = import_graph()
    costs = reachable(graph, "dspark_ds.cost")
    assert "dspark_ds.drafters.registry" in costs  # the kinds count their own FLOPs
    up = sorted(d for d in costs if d.startswith(("dspark_ds.train", "dspark_ds.tune")))
    assert up == []
    # both use it
    assert "dspark_ds.cost.flops" in graph["dspark_ds.train.trainer"]
    assert "dspark_ds.cost.inventory" in graph["dspark_ds.tune.estimate"]


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
    "drafters/dspark/blocks.py",
    "drafters/dspark/block_attention.py",
    "drafters/dspark/flex_mask.py",
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


# ---- imports at the top: an import inside a function says why it is there ------------------

MAX_LAZY_OWN_IMPORTS = 40
"""Imports of the package's own modules inside functions: each one keeps an entry point light
(`dspark-ds --help`, a subcommand's `--help`: the seconds measured in docs/testing.md) or is a
lazy name of a package's face."""
LAZY_REASON = re.compile(r"#\s*lazy:\s*\S")


def _import_runs(tree: ast.AST):
    """Each run of import statements inside a function: consecutive lines of one body."""
    seen: set[int] = set()
    for func in ast.walk(tree):
        if not isinstance(func, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        for node in ast.walk(func):
            for body in (getattr(node, f, None) for f in ("body", "orelse", "finalbody")):
                if not isinstance(body, list) or id(body) in seen:
                    continue
                seen.add(id(body))
                run: list[ast.stmt] = []
                for st in body:
                    if not isinstance(st, ast.Import | ast.ImportFrom):
                        continue
                    if run and st.lineno != run[-1].end_lineno + 1:
                        yield run
                        run = []
                    run.append(st)
                if run:
                    yield run


def lazy_imports(root: Path) -> list[tuple[str, bool, bool]]:
    """Each import statement inside a function under `root`: ("path:line", whether it imports
    the package itself, whether it says why: a `# lazy: <reason>` comment on its own lines, or
    on the comment lines just above the run of imports it is in)."""
    found = []
    for path in sorted(root.rglob("*.py")):
        lines = path.read_text().splitlines()
        with path.open("rb") as f:
            comments = {
                t.start[0]: t.string
                for t in tokenize.tokenize(f.readline)
                if t.type == tokenize.COMMENT
            }
        for run in _import_runs(ast.parse("\n".join(lines))):
            above, line = [], run[0].lineno - 1
            while line >= 1 and lines[line - 1].strip().startswith("#"):
                above.append(comments.get(line, ""))
                line -= 1
            for st in run:
                own = [comments.get(n, "") for n in range(st.lineno, st.end_lineno + 1)]
                module = st.module or "" if isinstance(st, ast.ImportFrom) else st.names[0].name
                is_own = module.split(".")[0] == root.name or bool(getattr(st, "level", 0))
                why = any(LAZY_REASON.search(c) for c in (*own, *above))
                found.append((f"{path.relative_to(root.parent)}:{st.lineno}", is_own, why))
    return found


def reimports(path: Path) -> list[str]:
    """The imports inside functions of `path` of what it already imports at its top (a module,
    or a name from a module): "line: statement"."""

    def imported(node) -> set[str]:
        if isinstance(node, ast.Import):
            return {a.name for a in node.names}
        return {f"{'.' * node.level}{node.module or ''}:{a.name}" for a in node.names}

    tree = ast.parse(path.read_text())
    top = set().union(
        *(imported(n) for n in tree.body if isinstance(n, ast.Import | ast.ImportFrom))
    )
    return [
        f"{st.lineno}: {ast.unparse(st)}"
        for run in _import_runs(tree)
        for st in run
        if imported(st) & top
    ]


def test_imports_inside_functions_say_why_and_few_are_the_packages_own():
    # an import belongs at the top of its module; one inside a function is an optional
    # dependency, an import cost an entry point must not pay (measured), or a lazy face
    found = lazy_imports(PACKAGE)
    unexplained = [where for where, _, why in found if not why]
    assert unexplained == [], "a `# lazy: <reason>` comment, or an import at the top"
    own = [where for where, is_own, _ in found if is_own]
    assert 0 < len(own) <= MAX_LAZY_OWN_IMPORTS, "\n".join(own)


def test_no_function_imports_what_its_module_imports_at_the_top():
    found = {
        str(p.relative_to(REPO)): lines
        for p in sorted(PACKAGE.rglob("*.py"))
        if (lines := reimports(p))
    }
    assert found == {}


def test_a_lazy_import_without_a_reason_and_a_reimport_are_found(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "a.py").write_text(
        "import json\nfrom pkg.b import B\n\n\n"
        "def f():\n"
        "    # lazy: a cycle through pkg.b\n"
        "    from pkg import b\n"
        "    import torch\n"
        "\n"
        "    import yaml\n"
        "    from pkg.c import C  # lazy: 2 s of import\n"
        "    import json\n"
        "    if b:\n"
        "        from pkg.b import B\n"
    )
    assert lazy_imports(pkg) == [
        ("pkg/a.py:7", True, True),
        ("pkg/a.py:8", False, True),
        ("pkg/a.py:10", False, False),
        ("pkg/a.py:11", True, True),
        ("pkg/a.py:12", False, False),
        ("pkg/a.py:14", True, False),
    ]
    assert reimports(pkg / "a.py") == ["12: import json", "14: from pkg.b import B"]


# ---- the formatter trusted: switched off only for a table ------------------------------------

FORMATTER_OFF_BUDGET = 30
"""`# fmt: skip` (or `# fmt: off`) comments allowed in each tree, dspark_ds/ and tests/: each
one on a table whose column alignment is the point; everything else is as ruff writes it."""
FMT_OFF = re.compile(r"\bfmt:\s*(skip|off)\b")


def formatter_off(root: Path) -> dict[str, int]:
    """Per file under `root`, its comments that switch the formatter off (a string that names
    one is not one)."""
    counts = {}
    for path in sorted(root.rglob("*.py")):
        with path.open("rb") as f:
            tokens = list(tokenize.tokenize(f.readline))
        found = [t for t in tokens if t.type == tokenize.COMMENT and FMT_OFF.search(t.string)]
        if found:
            counts[str(path.relative_to(root.parent))] = len(found)
    return counts


@pytest.mark.parametrize("tree", ["dspark_ds", "tests"])
def test_the_formatter_is_switched_off_only_for_tables(tree):
    counts = formatter_off(REPO / tree)
    total = sum(counts.values())
    listed = "\n".join(
        f"  {n:3d}  {path}" for path, n in sorted(counts.items(), key=lambda x: -x[1])
    )
    assert total <= FORMATTER_OFF_BUDGET, (
        f"{tree}/: {total} comments switch ruff off, at most {FORMATTER_OFF_BUDGET} (a table "
        f"whose alignment is the point; else let ruff format it, or restructure):\n{listed}"
    )


def test_a_formatter_off_comment_is_found(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "a.py").write_text(
        "ROWS = [(1,  2),\n        (10, 20)]  # fmt: skip\n"
        'TEXT = "# fmt: skip"  # a string is not one\n'
        "# fmt: off\nX = [1,2]\n# fmt: on\n"
    )
    (tmp_path / "pkg" / "b.py").write_text("Y = 1\n")
    assert formatter_off(tmp_path / "pkg") == {"pkg/a.py": 2}


# ---- sizes: a file a reader can hold, a function that fits on a screen ----------------------

MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 80


def long_files(root: Path, limit: int) -> dict[str, int]:
    """Per file under `root` of more than `limit` lines, its lines."""
    counts = {
        str(path.relative_to(root.parent)): len(path.read_text().splitlines())
        for path in sorted(root.rglob("*.py"))
    }
    return {path: n for path, n in counts.items() if n > limit}


def long_functions(root: Path, limit: int) -> dict[str, int]:
    """Per function under `root` of more than `limit` lines (its `def` to its last line; a
    nested function counts on its own too), "path:Class.name" -> its lines."""
    found = {}

    def visit(node, path: str, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if not isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                visit(child, path, prefix)
                continue
            lines = child.end_lineno - child.lineno + 1
            if not isinstance(child, ast.ClassDef) and lines > limit:
                found[f"{path}:{prefix}{child.name}"] = lines
            visit(child, path, f"{prefix}{child.name}.")

    for path in sorted(root.rglob("*.py")):
        visit(ast.parse(path.read_text()), str(path.relative_to(root.parent)), "")
    return found


def _listed(counts: dict[str, int]) -> str:
    return "\n".join(f"  {n:4d}  {what}" for what, n in sorted(counts.items(), key=lambda x: -x[1]))


def test_no_package_file_is_over_600_lines():
    # a file past this holds more than one job: split it by concern, each module named for what
    # it holds
    found = long_files(PACKAGE, MAX_FILE_LINES)
    assert found == {}, f"over {MAX_FILE_LINES} lines:\n{_listed(found)}"


def test_no_package_function_is_over_80_lines():
    # a stage too long for a screen is split into steps
    found = long_functions(PACKAGE, MAX_FUNCTION_LINES)
    assert found == {}, f"over {MAX_FUNCTION_LINES} lines:\n{_listed(found)}"


def test_a_long_file_and_function_are_found(tmp_path):
    (tmp_path / "pkg").mkdir()
    statements = "        x = 1\n" * 4
    (tmp_path / "pkg" / "a.py").write_text(
        f"class A:\n    def long(self):\n{statements}\n\n"
        "def short():\n    return 1\n\n\n"
        f"def outer():\n    def inner():\n{statements}    return inner\n"
    )
    (tmp_path / "pkg" / "b.py").write_text("Y = 1\n")
    assert long_files(tmp_path / "pkg", 10) == {"pkg/a.py": 19}
    assert long_functions(tmp_path / "pkg", 4) == {
        "pkg/a.py:A.long": 5,
        "pkg/a.py:outer": 7,
        "pkg/a.py:outer.inner": 5,
    }


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


def calls_at_import(path: Path, *names: str) -> list[int]:
    """Lines where `path` calls one of `names` at its own import (outside any function)."""
    tree = ast.parse(path.read_text())
    functions = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
    inside = {id(n) for f in functions for n in ast.walk(f)}
    return [
        n.lineno
        for n in ast.walk(tree)
        if isinstance(n, ast.Call)
        and id(n) not in inside
        and (getattr(n.func, "id", None) in names or getattr(n.func, "attr", None) in names)
    ]


def test_importing_the_package_registers_nothing_with_transformers():
    # transformers' Auto tables learn the drafters only from an explicit call
    # (drafters.register_auto_classes), never as an import's side effect
    found = {
        str(p.relative_to(REPO)): lines
        for p in sorted(PACKAGE.rglob("*.py"))
        if (lines := calls_at_import(p, "register_auto_classes", "register"))
    }
    assert found == {}


def test_a_call_at_import_is_found(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("register_auto_classes()\n\ndef f():\n    register_auto_classes()\n")
    assert calls_at_import(path, "register_auto_classes") == [1]


def test_data_does_not_import_the_trainer():
    # the data pipeline sits below the trainer: it raises what it needs from errors.py
    graph = import_graph()
    up = sorted(
        f"{m} -> {d}"
        for m, deps in graph.items()
        if m.startswith("dspark_ds.data")
        for d in deps
        if d.startswith("dspark_ds.train")
    )
    assert up == []


# ---- the kind seam: no module outside drafters/ names a drafter kind -------------------------


def _kind_words() -> set[str]:
    from dspark_ds.drafters.presets import PRESET_NAMES
    from dspark_ds.drafters.registry import KINDS

    return set(KINDS) | set(PRESET_NAMES)


def _names_a_kind(ident: str, words: set[str]) -> bool:
    """An identifier with a kind's name in it, in any case (`eagle3_layers`, `DSPARK_LOSS`,
    `DSparkDraftModel`); the package's own name, dspark_ds, is not a kind (a private attribute
    the package sets on another library's object is prefixed with it: `_dspark_ds_...`)."""
    ident = ident.lower().replace("dspark_ds", "")
    return any(w in ident for w in words)


def kind_names_in(path: Path, words: set[str]) -> list[str]:
    """Where `path` names a kind: a string that is a kind's (or a preset's) name, an identifier
    with one as a word (`eagle3_layers`, `DSPARK_LOSS`), or an import of a kind's own folder.
    Docstrings, comments and messages' prose may name kinds; code may not."""
    tree = ast.parse(path.read_text())
    docstrings = {
        id(st.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        for st in node.body
        if isinstance(st, ast.Expr) and isinstance(st.value, ast.Constant)
    }
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant):
            if isinstance(node.value, str) and id(node) not in docstrings:
                if node.value.lower() in words:
                    found.append(repr(node.value))
            continue
        if isinstance(node, ast.Name):
            names = [node.id]
        elif isinstance(node, ast.Attribute):
            names = [node.attr]
        elif isinstance(node, ast.arg):
            names = [node.arg]
        elif isinstance(node, ast.keyword):
            names = [node.arg or ""]
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names = [node.name]
        elif isinstance(node, ast.alias):
            names = [*node.name.split("."), node.asname or ""]
        elif isinstance(node, ast.ImportFrom):
            names = (node.module or "").split(".")
        else:
            continue
        found += [n for n in names if n and _names_a_kind(n, words)]
    return found


def test_no_module_outside_the_drafters_names_a_kind():
    # what a kind contributes (config fields, step shape, demo sizes, eval tags, ...) comes from
    # the kind (drafters/<kind>/kind.py, the registry) or its presets: adding a kind touches no
    # module outside drafters/
    words = _kind_words()
    assert {"dspark", "eagle3", "dflash"} <= words  # read from the registry and the presets
    found = {
        (str(p.relative_to(REPO)), what)
        for p in sorted(PACKAGE.rglob("*.py"))
        if "drafters" not in p.relative_to(PACKAGE).parts
        for what in kind_names_in(p, words)
    }
    assert sorted(found) == []  # no exceptions


def test_a_kind_name_is_found(tmp_path):
    path = tmp_path / "m.py"
    path.write_text(
        '"""dspark"""\n'
        "import dspark_ds.drafters.eagle3.loss\n"
        "from dspark_ds.drafters.dspark.step import forward_loss\n"
        "from dspark_ds import drafters\n"
        'x = {"dspark": 1}  # dspark in a comment is prose\n'
        "eagle3_layers = DSparkThing(dflash=2)\n"
        'y = "DSpark drafts blocks"\n'
        'z = "dspark_ds/recipes/a.yaml"\n'
    )
    found = kind_names_in(path, {"dspark", "dflash", "eagle3"})
    assert sorted(found) == sorted(
        ["eagle3", "dspark", "'dspark'", "eagle3_layers", "DSparkThing", "dflash"]
    )


# ---- docs/architecture.md's layout is the package's ------------------------------------------

NAME_COLUMN = 24  # a tree line's name starts before this column; its description after


def layout_entries(text: str) -> list[tuple[Path, str, bool]]:
    """(path in the repo, description, is a folder) of each entry of the first code block of
    docs/architecture.md: the tree, two spaces per level."""
    block = text.split("```\n", 2)[1]
    entries: list[list] = []
    folders: list[tuple[int, Path]] = []
    for line in block.splitlines():
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        first, _, rest = line.strip().partition(" ")
        if indent < NAME_COLUMN and re.fullmatch(r"[\w.-]+/?", first):
            while folders and folders[-1][0] >= indent:
                folders.pop()
            path = (folders[-1][1] if folders else Path()) / first.rstrip("/")
            entries.append([path, rest.strip(), first.endswith("/")])
            if first.endswith("/"):
                folders.append((indent, path))
        else:
            entries[-1][1] += " " + line.strip()
    return [tuple(e) for e in entries]


def layout_problems(text: str, repo: Path) -> list[str]:
    """What the layout claims that the package contradicts: an entry or a module it names
    that does not exist, a package module or subpackage its folder's entry does not name."""
    entries = layout_entries(text)
    problems = [f"{p}: does not exist" for p, _, _ in entries if not (repo / p).exists()]
    for path, description, is_folder in entries:
        here = path if is_folder else path.parent
        for named in re.findall(r"[\w/]+\.py\b", description):
            if not any((repo / d / named).exists() for d in (here, *here.parents)):
                problems.append(f"{path}: names {named}, which does not exist")
    for path, _, is_folder in entries:
        if not is_folder or not (repo / path / "__init__.py").exists():
            continue
        text_of = " ".join(
            f"{p.name}{'/' if f else ''} {d}" for p, d, f in entries if path in (p, *p.parents)
        )
        named = {n.rpartition("/")[2] for n in re.findall(r"[\w/]+\.py\b", text_of)}
        named |= {p.name for p, _, _ in entries if p.parent == path}
        for module in sorted((repo / path).iterdir()):
            if module.name in ("__init__.py", "__pycache__"):
                continue
            is_package = (module / "__init__.py").exists()
            if (module.suffix == ".py" or is_package) and module.name not in named:
                problems.append(f"{path}: does not list {module.name}")
    return problems


def test_the_architecture_doc_lists_the_package():
    text = (REPO / "docs" / "architecture.md").read_text()
    assert len(layout_entries(text)) > 40
    assert layout_problems(text, REPO) == []


def test_the_architecture_doc_names_the_test_layers_and_the_tools():
    # its "Tests and tools" part: a folder of tests/ or a file of tools/ it does not name is one
    # a reader of this page does not know is there
    text = (REPO / "docs" / "architecture.md").read_text()
    part = text.split("## Tests and tools", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"`([\w.-]+/?)`", part))
    tests = {p.name + "/" for p in (REPO / "tests").iterdir() if p.is_dir()} - {"__pycache__/"}
    tests |= {p.name for p in (REPO / "tests").glob("*.py") if p.name != "conftest.py"}
    tools = {p.name for p in (REPO / "tools").iterdir() if p.is_file()}
    assert sorted((tests | tools) - named) == []
    for section in ("## The training step", "## The tune loop", "## Tests and tools"):
        assert section in text, section


def test_a_layout_problem_is_found(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    for f in ("__init__.py", "a.py", "b.py", "sub/__init__.py", "sub/c.py"):
        (pkg / f).write_text("")
    text = (
        "```\npkg/\n  a.py                    the a module, with gone.py\n"
        "  sub/                    c.py\n  old.py                  removed\n```\n"
    )
    assert layout_problems(text, tmp_path) == [
        "pkg/old.py: does not exist",
        "pkg/a.py: names gone.py, which does not exist",
        "pkg: does not list b.py",
    ]
