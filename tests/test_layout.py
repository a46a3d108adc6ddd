"""The layout's promises: no import cycle anywhere, and the engine imports no plugin.

The graph is built from the source with ``ast`` (every ``import`` and ``from ...
import`` that runs, those under ``if TYPE_CHECKING:`` included, so a cycle hidden
from the interpreter is still one for a reader), over the project's packages.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("decoders", "proposers", "verifiers", "train")


def module_name(path: Path) -> str:
    """The installed name of a source file: its folder path under the ``specdec`` namespace."""
    parts = ["specdec", *path.relative_to(REPO_ROOT).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules() -> dict[str, Path]:
    return {
        module_name(path): path
        for package in PACKAGES
        for path in sorted((REPO_ROOT / package).rglob("*.py"))
        if "shipped" not in path.parts
    }


def imported(tree: ast.AST, module: str, is_package: bool, known: set[str]) -> set[str]:
    """The project modules ``module`` imports (``from a import b`` counts a.b when
    it is a module, else a)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".") if is_package else module.split(".")[:-1]
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                names.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
    return {name for name in names if name in known and name != module}


def import_graph() -> dict[str, set[str]]:
    modules = project_modules()
    known = set(modules)
    return {
        name: imported(ast.parse(path.read_text()), name, path.name == "__init__.py", known)
        for name, path in modules.items()
    }


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a list of modules, or None (depth-first search)."""
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for child in sorted(graph[node]):
            if state.get(child) == 1:
                return path[path.index(child) :] + [child]
            if child not in state and (cycle := visit(child)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_project_has_no_import_cycle():
    graph = import_graph()
    assert {
        "specdec.decoders.engine.decoding",
        "specdec.proposers.ngram",
        "specdec.verifiers.greedy",
        "specdec.train.job",
    } <= set(graph)
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph) or [])


def test_the_cycle_finder_finds_cycles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_the_engine_imports_no_plugin():
    """Nothing in decoders.engine, models or sizing names a proposer or verifier module."""
    graph = import_graph()
    core = [
        m
        for m in graph
        if m.split(".")[1:3] in (["decoders", "engine"], ["decoders", "models"], ["decoders", "sizing"])
    ]
    for module in core:
        plugins = {m for m in graph[module] if m.split(".")[1] in ("proposers", "verifiers")}
        assert not plugins, f"{module} imports {plugins}"


def in_fresh_interpreter(code: str) -> str:
    """What ``code`` prints, run by a fresh interpreter in another directory (so only the
    installed names can be imported)."""
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=Path(tempfile.gettempdir()),
        capture_output=True,
        text=True,
        check=True,
    )
    return result.stdout.strip()


def test_importing_decoders_leaves_the_plugins_unimported():
    code = (
        "import sys, specdec.decoders\n"
        "from specdec.decoders.engine.registry import proposer_registry, verifier_registry\n"
        "assert 'ngram' in proposer_registry.names() and 'greedy' in verifier_registry.names()\n"
        "print(sorted(m for m in sys.modules if m.split('.')[:2] in (['specdec', 'proposers'], "
        "['specdec', 'verifiers'])))\n"
    )
    assert in_fresh_interpreter(code) == "[]"


#: The layers, lowest first: a module imports only from its own layer or lower ones
#: (the registries reach proposers and verifiers by module name, not by import).
#: docs/architecture.md draws them, highest first (``test_the_architecture_doc_draws_these_layers``).
LAYERS = (
    ("decoders.models",),
    ("decoders.engine",),
    ("decoders.sizing",),
    ("proposers", "verifiers"),
    ("decoders.cli",),
    ("decoders.evaluation",),
    ("decoders",),  # the package's public names and the command-line entry points
    ("train",),
)

#: Names a lower layer binds late, by module name rather than import: the only upward
#: dependencies allowed, each with why. Any other module name in a string is an edge too.
LATE_BINDINGS = {
    ("specdec.decoders.engine.registry", "specdec.proposers"): "built-in proposers, imported on first lookup",
    ("specdec.decoders.engine.registry", "specdec.verifiers"): "built-in verifiers, imported on first lookup",
    (
        "specdec.decoders.engine.registry",
        "specdec.decoders.sizing",
    ): "the default SizingPolicy (typed by engine.context.Sizing)",
    (
        "specdec.proposers",
        "specdec.train",
    ): "a drafter's trainer, declared on its proposer, imported by train",
}


def layer_of(module: str) -> int:
    parts = module.split(".")[1:]  # without the namespace
    name = ".".join(parts[:2]) if parts[0] == "decoders" and len(parts) > 2 else parts[0]
    return next(rank for rank, names in enumerate(LAYERS) if name in names)


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return sorted(
        f"{module} -> {target}"
        for module, targets in graph.items()
        for target in targets
        if layer_of(target) > layer_of(module)
    )


def test_nothing_imports_upward():
    assert not upward_imports(import_graph()), upward_imports(import_graph())


def test_a_planted_upward_import_is_found():
    """The check can fail: the real graph plus one import of the bench by the models layer."""
    graph = import_graph()
    assert "specdec.decoders.models.cost" in graph and "specdec.decoders.evaluation.benchmark" in graph
    graph["specdec.decoders.models.cost"] = graph["specdec.decoders.models.cost"] | {
        "specdec.decoders.evaluation.benchmark"
    }
    assert upward_imports(graph) == ["specdec.decoders.models.cost -> specdec.decoders.evaluation.benchmark"]
    planted = "from specdec.decoders.evaluation import benchmark\n"
    known = set(graph)
    found = imported(ast.parse(planted), "specdec.decoders.models.cost", False, known)
    assert found == {"specdec.decoders.evaluation.benchmark"}


def module_names_in_strings(tree: ast.AST) -> set[str]:
    """``"specdec.x.y"`` or ``"specdec.x.y:Class"`` string constants: imports made at run time."""
    return {
        node.value.split(":")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and re.fullmatch(r"specdec(\.\w+)+(:\w+)?", node.value)
    }


def test_late_bindings_are_the_declared_ones():
    """A module named in a string is imported all the same: each such upward edge must be one
    of ``LATE_BINDINGS`` (the registries' built-ins and the default sizing policy)."""
    modules = project_modules()
    found = set()
    for module, path in modules.items():
        for name in module_names_in_strings(ast.parse(path.read_text())):
            target = next((m for m in (name, name.rsplit(".", 1)[0]) if m in modules), None)
            if target is None or layer_of(target) <= layer_of(module):
                continue
            declared = [
                key for key in LATE_BINDINGS if module.startswith(key[0]) and target.startswith(key[1])
            ]
            found.add(declared[0] if declared else (module, target))
    assert found == set(LATE_BINDINGS), sorted(found ^ set(LATE_BINDINGS))


def test_the_architecture_doc_draws_these_layers():
    """docs/architecture.md's diagram, highest layer first, names the same layers in the same
    order as ``LAYERS``."""
    doc = (REPO_ROOT / "docs" / "architecture.md").read_text()
    diagram = doc.split("## The layers", 1)[1].split("```", 2)[1]
    drawn = []
    for line in diagram.splitlines():
        head = line.split("   ")[0].strip()
        if not head:
            continue
        names = tuple(
            sorted(
                "decoders" if "{" in word else word.strip("/").replace("/", ".")
                for word in head.split()
                if word.rstrip("/").split("/")[0] in PACKAGES
            )
        )
        if names:
            drawn.append(names)
    assert drawn[::-1] == [tuple(sorted(layer)) for layer in LAYERS], drawn


def test_every_import_of_the_project_names_its_installed_package():
    """The folders install under ``specdec`` (setup.py): a bare ``import decoders`` works in a
    checkout, where the repository root is on the path, and fails once installed."""
    bare = sorted(
        f"{path.relative_to(REPO_ROOT)}:{node.lineno}"
        for path in [*project_modules().values(), *sorted((REPO_ROOT / "tests").rglob("*.py"))]
        for node in ast.walk(ast.parse(path.read_text()))
        for name in (
            [alias.name for alias in node.names]
            if isinstance(node, ast.Import)
            else [node.module or ""]
            if isinstance(node, ast.ImportFrom) and not node.level
            else []
        )
        if name.split(".")[0] in PACKAGES
    )
    assert not bare, bare


def test_importing_one_train_module_imports_no_other_part():
    """``specdec.train``'s modules import what they use, not the whole package: its checkpoints
    import no drafter, no proposer and no training loop."""
    code = (
        "import sys, specdec.train.checkpoints\n"
        "print(sorted(m for m in sys.modules if m.startswith(('specdec.train.', 'specdec.proposers'))))\n"
    )
    assert in_fresh_interpreter(code) == "['specdec.train.checkpoints']"


#: The most lines a file has unless docs/architecture.md's "Files over 400 lines" table lists it.
MOST_LINES = 400


def line_counts() -> dict[str, int]:
    """Every tracked ``.py`` file's lines (as ``wc -l`` counts them), by its path in the repository."""
    tracked = subprocess.run(
        ["git", "ls-files", "*.py"], cwd=REPO_ROOT, capture_output=True, text=True, check=True
    ).stdout.splitlines()
    return {
        name: (REPO_ROOT / name).read_bytes().count(b"\n") for name in tracked if (REPO_ROOT / name).is_file()
    }


def listed_long_files(doc: str) -> set[str]:
    """The paths in the first column of the architecture doc's "Files over 400 lines" table, one a row."""
    section = doc.split("## Files over 400 lines", 1)[1].split("\n## ", 1)[0]
    return {line.split("|")[1].strip().strip("`") for line in section.splitlines() if line.startswith("| `")}


def unjustified_lengths(doc: str, counts: dict[str, int]) -> tuple[list[str], list[str]]:
    """(files over ``MOST_LINES`` the table does not list, rows of the table naming no file over it)."""
    listed = listed_long_files(doc)
    over = {name for name, lines in counts.items() if lines > MOST_LINES}
    return sorted(over - listed), sorted(listed - over)


def test_every_file_over_400_lines_is_listed_with_its_reason():
    """A file grows past 400 lines only with a row in docs/architecture.md's table saying why; a row
    whose file is gone or back under 400 lines goes too."""
    doc = (REPO_ROOT / "docs" / "architecture.md").read_text()
    counts = line_counts()
    unlisted, stale = unjustified_lengths(doc, counts)
    assert not unlisted, (
        f'over {MOST_LINES} lines and not in docs/architecture.md\'s "Files over 400 lines" table: '
        + ", ".join(f"{name} ({counts[name]})" for name in unlisted)
        + "; split it along a seam, or add a row saying why it is one file"
    )
    assert not stale, f"docs/architecture.md's table lists files not over {MOST_LINES} lines: {stale}"


def test_a_long_file_missing_from_the_table_is_found():
    """The check can fail: the real doc without one of its rows, and a file it never listed."""
    doc = (REPO_ROOT / "docs" / "architecture.md").read_text()
    listed = sorted(listed_long_files(doc))
    assert "train/medusa.py" in listed and len(listed) > 3, listed
    counts = {name: MOST_LINES + 1 for name in listed} | {"decoders/new.py": MOST_LINES + 1, "short.py": 10}
    without = "\n".join(line for line in doc.splitlines() if not line.startswith("| `train/medusa.py`"))
    assert unjustified_lengths(without, counts) == (["decoders/new.py", "train/medusa.py"], [])
    assert unjustified_lengths(doc, {**counts, "train/medusa.py": MOST_LINES}) == (
        ["decoders/new.py"],
        ["train/medusa.py"],
    )
