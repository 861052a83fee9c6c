"""The house keeps its floors (DESIGN.md, "Layers"): read from the source with ``ast``, no import.

* a package imports only packages above it in :data:`LAYERS` (and itself);
* nothing imports :mod:`paraloom.commands` but the command line itself (``paraloom/__main__.py``);
* no function-local paraloom import outside ``commands/`` (they hid import circles); optional
  third-party packages may still be imported where they are used;
* no import cycle between modules;
* command-line code (``argparse``) lives in ``commands/`` only;
* every module has at most :data:`MAX_LINES` lines (:data:`LONG` lists the exceptions, with why);
* every function has at most :data:`MAX_FUNCTION_LINES` lines (:data:`LONG_FUNCTIONS` lists the
  exceptions, with why; none today);
* no module but :mod:`paraloom.analysis.view` turns a run's ``config.json`` into a ``CommConfig``
  (:data:`BUILDERS` lists the other builders, with why);
* comments and docstrings do not cite internal issue numbers.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "paraloom"

LAYERS = ("config", "utils", "device", "grid", "mesh", "parallel_state", "ledger", "comm_wait",
          "comm", "run_folder",
          "heartbeat", "launch", "tensor_parallel", "context_parallel", "moe", "pipeline_parallel",
          "data_parallel", "models", "data", "training", "analysis", "verify", "measure", "record",
          "diagnose", "explain", "llm", "report", "commands")
"""The floors, top to bottom: each may import the ones before it."""

MAX_LINES = 300
LONG: dict[str, str] = {}
MAX_FUNCTION_LINES = 80
LONG_FUNCTIONS: dict[str, str] = {}
"""Functions longer than :data:`MAX_FUNCTION_LINES`, each with why it is still long."""
BUILDERS = {
    "analysis/view.py": "the view itself: a TrainConfig as the formulas see it",
    "analysis/search.py": "plan --search's candidate layouts, from its own flags",
    "verify/validation.py": "published Megatron runs, described by their papers' numbers",
}
"""Modules that construct ``CommConfig`` besides the view, each with why."""
"""Modules allowed past :data:`MAX_LINES`, each with its reason (none today)."""


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


MODULES = _modules()


def _target(module: str, node: ast.ImportFrom | ast.Import, path: Path) -> list[str]:
    """The paraloom modules an import statement names (a package's ``__init__`` for
    ``from package import name`` when ``name`` is not a module of it)."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = module.split(".")
        if path.name != "__init__.py":
            base = base[:-1]
        if node.level:
            base = base[:len(base) - (node.level - 1)]
            prefix = ".".join(base + ([node.module] if node.module else []))
        else:
            prefix = node.module or ""
        names = [f"{prefix}.{a.name}" if f"{prefix}.{a.name}" in MODULES else prefix
                 for a in node.names]
    out = []
    for name in names:
        while name and name not in MODULES:
            name = name.rpartition(".")[0]
        if name.startswith("paraloom"):
            out.append(name)
    return out


def _floor(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def _imports() -> list[tuple[str, str, int, bool, bool]]:
    """``(importer, imported, line, at module level, only for type checking)``."""
    out = []
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text())
        top = {id(n) for n in tree.body}
        checking = set()
        for node in tree.body:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                checking |= {id(n) for n in ast.walk(node)}
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in _target(module, node, path):
                    out.append((module, target, node.lineno, id(node) in top,
                                id(node) in checking))
    return out


IMPORTS = _imports()


def test_every_package_is_on_a_floor():
    floors = {_floor(m) for m in MODULES if _floor(m) not in (None, "__main__")}
    assert floors <= set(LAYERS), sorted(floors - set(LAYERS))


def test_packages_import_only_floors_above_them():
    bad = []
    for a, b, line, _, _ in IMPORTS:
        fa, fb = _floor(a), _floor(b)
        if fa in (None, "__main__") or fb is None or fa == fb:
            continue  # paraloom/__init__ (the public names) and the entry point see everything
        if LAYERS.index(fb) > LAYERS.index(fa):
            bad.append(f"{a} (line {line}) imports {b}: {fb} is below {fa}")
    assert not bad, "\n".join(bad)


def test_nothing_in_the_library_imports_the_command_line():
    bad = [f"{a} (line {line})" for a, b, line, _, _ in IMPORTS
           if _floor(b) == "commands" and _floor(a) not in ("commands", "__main__")]
    assert not bad, bad


def test_no_function_local_paraloom_imports_outside_commands():
    bad = [f"{a} line {line}: {b}" for a, b, line, top, checking in IMPORTS
           if not top and not checking and _floor(a) != "commands"]
    assert not bad, "\n".join(bad)


def test_no_import_cycles():
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for a, b, _, top, checking in IMPORTS:
        if top and not checking and a != b:
            graph[a].add(b)
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for module in sorted(graph):
        if module not in state and (cycle := visit(module)):
            pytest.fail("import cycle: " + " -> ".join(cycle))


def test_command_line_code_lives_in_commands():
    bad = [str(p.relative_to(ROOT)) for m, p in MODULES.items()
           if _floor(m) != "commands" and re.search(r"^\s*import argparse\b", p.read_text(), re.M)]
    assert not bad, bad


def test_modules_are_short():
    long = {str(p.relative_to(ROOT)): n for p in MODULES.values()
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert set(long) <= set(LONG), {k: v for k, v in long.items() if k not in LONG}


def test_functions_are_short():
    long = {}
    for p in MODULES.values():
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long[f"{p.relative_to(ROOT)}:{node.name}"] = n
    assert set(long) <= set(LONG_FUNCTIONS), {k: v for k, v in long.items()
                                              if k not in LONG_FUNCTIONS}
    gone = set(LONG_FUNCTIONS) - set(long)  # split since: take it off the list
    assert not gone, gone


def test_comm_config_is_built_only_by_the_view():
    built = {str(p.relative_to(ROOT)) for p in MODULES.values()
             if re.search(r"\bCommConfig\(", p.read_text())}
    assert built <= set(BUILDERS), built - set(BUILDERS)
    assert set(BUILDERS) <= built, set(BUILDERS) - built  # a listed module that no longer does
    assert "verify/check.py" not in built and "commands/plan.py" not in built


def test_no_internal_issue_numbers_in_the_source():
    # another project's tracker may be cited by name ("Megatron-LM issue 737")
    pattern = re.compile(r"(?<!Megatron-LM )(?<!PyTorch )\bissues? #?\d+", re.I)
    bad = [f"{p.relative_to(ROOT)}:{i}" for p in MODULES.values()
           for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert not bad, bad


PURE_HELPERS = {
    "paraloom.data_parallel.grad_buffer": "bucket_layout: the buckets a buffer makes (arithmetic)",
    "paraloom.data_parallel.fsdp_layout": "fsdp_layout: Megatron-FSDP's buckets (arithmetic)",
    "paraloom.data_parallel.fsdp_unshard_plan": "zero3_gathers: Megatron-FSDP's ZeRO-3 rules",
    "paraloom.moe.router": "expert_capacity: Megatron's capacity rule (arithmetic)",
    "paraloom.pipeline_parallel.timetable": "the schedules' timetables and bubble (arithmetic)",
    "paraloom.pipeline_parallel.plans": "each stage's p2p plan, which the runtime executes",
    "paraloom.pipeline_parallel.stage": "which layers a stage and chunk hold",
}
"""Modules of lower floors whose pure functions the formulas share with the runtime, with why."""


def test_analysis_is_formulas_only():
    """The analysis floor is split by job: its modules compute (no torch, no rank, no run
    folder); checking runs is :mod:`paraloom.verify`, measuring is :mod:`paraloom.measure`."""
    bad = [(a, b, line) for a, b, line, _, _ in IMPORTS
           if _floor(a) == "analysis" and _floor(b) not in ("analysis", "config", "utils")
           and b not in PURE_HELPERS]
    assert not bad, bad
    torch_users = [m for m, p in MODULES.items() if _floor(m) == "analysis"
                   and re.search(r"^\s*(import torch|from torch)", p.read_text(), re.M)]
    assert not torch_users, torch_users
    assert {_floor(m) for m in MODULES if m.endswith((".check", ".validation"))
            and _floor(m) in ("analysis", "verify")} == {"verify"}
    assert {m for m in MODULES if _floor(m) == "measure"} == {
        "paraloom.measure", "paraloom.measure.calibrate", "paraloom.measure.memory"}
