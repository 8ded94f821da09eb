"""The package's import graph (ast, counting imports inside functions): no cycle, and the
layer order of docs/architecture.md — every import points to the same layer or one below it
(``parallel/`` < ``ops/`` < ``data/`` < ``models/`` < ``losses/`` < ``train/`` < ``reliability/``
< the Lightning layer < the RL layer), and nothing in the package imports ``testing/``.

An edge ``a -> b`` is every ``import`` / ``from ... import`` statement of ``a`` (module level or
inside a function, relative ones resolved; ``from pkg import name`` is an edge to ``pkg.name``
when that is a submodule, else to ``pkg``), except those under ``if TYPE_CHECKING:``, which
never run. Importing ``a.b.c`` also runs ``a/__init__`` and ``a/b/__init__``; those implicit
parent edges are not counted (every module would then reach ``lightning_mcore_rl/__init__``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import lightning_mcore_rl

PACKAGE = "lightning_mcore_rl"
ROOT = Path(lightning_mcore_rl.__file__).parent
STEP_LAYERS = ("train", "losses", "ops", "data", "models")
LIGHTNING_LAYER = ("strategy", "callbacks", "recipes", "module")
# Bottom up; a module may import its own layer and those below. The first row are leaf helpers
# (version shims, megatron's defaults, the rank-error types, metric reductions); "" is the
# package's __init__, which registers the strategy, and the `lmrl` entry point that imports it.
LAYER_ORDER: tuple[tuple[str, ...], ...] = (
    ("_compat", "megatron_defaults", "rank_errors", "metrics"),
    ("cpu",),
    ("parallel",),
    ("ops",),
    ("data",),
    ("models",),
    ("losses",),
    ("extensions",),
    ("train",),
    ("reliability",),
    ("strategy", "callbacks", "module"),
    ("rollout", "algorithms", "rewards", "recipes"),
    ("", "cli"),
)


def _module_name(path: Path) -> str:
    parts = [PACKAGE, *path.relative_to(ROOT).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement in ``tree``, at any depth, outside ``if TYPE_CHECKING:``."""
    found: list[ast.Import | ast.ImportFrom] = []
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        stack.extend(ast.iter_child_nodes(node))
    return found


def _targets(module: str, node: ast.Import | ast.ImportFrom) -> set[str]:
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names}
    base = node.module or ""
    if node.level:
        package = module if MODULES[module].name == "__init__.py" else module.rsplit(".", 1)[0]
        for _ in range(node.level - 1):
            package = package.rsplit(".", 1)[0]
        base = f"{package}.{base}" if base else package
    submodules = {f"{base}.{alias.name}" for alias in node.names} & MODULES.keys()
    plain = [alias for alias in node.names if f"{base}.{alias.name}" not in MODULES]
    return submodules | ({base} if plain else set())


def import_graph() -> dict[str, set[str]]:
    """``module -> the package modules it imports``."""
    graph: dict[str, set[str]] = {}
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        edges = set().union(*(_targets(module, node) for node in _imports(tree)))
        graph[module] = {e for e in edges if e in MODULES and e != module}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle (``[a, b, ..., a]``), or ``None``."""
    state: dict[str, int] = {}  # 1: on the DFS stack, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)) is not None:
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)) is not None:
            return cycle
    return None


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_the_walker_sees_function_level_relative_and_submodule_imports() -> None:
    """The graph is the one the checks below read: known edges of each kind are in it."""
    graph = import_graph()
    # a function-level import (module.py imports the statistics inside configure_callbacks)
    assert f"{PACKAGE}.callbacks.training_statistics" in graph[f"{PACKAGE}.module"]
    # `from lightning_mcore_rl.train import cp_layout as pg`: the submodule, not the package
    assert f"{PACKAGE}.train.cp_layout" in graph[f"{PACKAGE}.train.post_processors"]
    # a cycle is found when there is one
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_module_imports_another_in_a_cycle() -> None:
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


@pytest.mark.parametrize("layer", STEP_LAYERS)
def test_the_step_layers_never_import_the_lightning_layer(layer: str) -> None:
    bad = sorted(
        f"{module} -> {target}"
        for module, targets in import_graph().items()
        if _layer(module) == layer
        for target in targets
        if _layer(target) in LIGHTNING_LAYER
    )
    assert not bad, bad


def _rank(layer: str) -> int:
    return next(i for i, row in enumerate(LAYER_ORDER) if layer in row)


def test_every_layer_of_the_package_has_a_place_in_the_order() -> None:
    missing = sorted({_layer(m) for m in MODULES} - {"testing"} - set().union(*LAYER_ORDER))
    assert not missing, f"layers without a place in LAYER_ORDER: {missing}"


def test_imports_point_down_the_layer_order_and_never_into_testing() -> None:
    bad = sorted(
        f"{module} -> {target}"
        for module, targets in import_graph().items()
        if _layer(module) != "testing"
        for target in targets
        if _layer(target) == "testing" or _rank(_layer(target)) > _rank(_layer(module))
    )
    assert not bad, bad


# Where megatron's parallel_state may be imported: the one read (``parallel/groups.py``, for the
# strategy and the seed API's callers without groups), the strategy's set-up (``parallel.py``),
# the single-process export (builds its own TP=PP=1 state), the test infrastructure and the CPU
# backend. Everything else (the model builders included) takes ``ParallelGroups`` arguments.
PARALLEL_STATE_READERS = (
    "parallel.groups",
    "strategy.parallel",
    "strategy.export",
    "testing",
    "cpu",
)
_STATE_MODULES = {"megatron.core.parallel_state", "megatron.core.mpu"}


def imports_parallel_state(tree: ast.AST) -> bool:
    """Whether ``tree`` imports megatron's ``parallel_state`` (or its alias ``mpu``) in any form,
    at any depth (``TYPE_CHECKING`` blocks included)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = {node.module, *(f"{node.module}.{alias.name}" for alias in node.names)}
        else:
            continue
        if any(n in _STATE_MODULES or n.startswith("megatron.core.parallel_state.") for n in names):
            return True
    return False


def test_the_parallel_state_detector_sees_every_import_form() -> None:
    for source in (
        "from megatron.core import parallel_state as ps",
        "def f():\n    from megatron.core import mpu",
        "import megatron.core.parallel_state",
        "from megatron.core.parallel_state import get_tensor_model_parallel_rank",
    ):
        assert imports_parallel_state(ast.parse(source)), source
    for source in ("from megatron.core import tensor_parallel", "x = 'parallel_state'"):
        assert not imports_parallel_state(ast.parse(source)), source


def test_only_the_strategy_set_up_export_testing_and_cpu_import_parallel_state() -> None:
    def allowed(module: str) -> bool:
        inner = module.removeprefix(f"{PACKAGE}.")
        return any(inner == p or inner.startswith(f"{p}.") for p in PARALLEL_STATE_READERS)

    readers = sorted(
        module
        for module, path in MODULES.items()
        if not allowed(module) and imports_parallel_state(ast.parse(path.read_text()))
    )
    assert not readers, f"modules reading megatron's parallel_state: {readers}"
