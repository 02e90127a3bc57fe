"""Import rules of the package (docs/architecture.md): no import cycles, lower floors never import upward."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "astrl"

# the ground floor, and the library pieces built on it: none of them may import the layers that use them
GROUND = (
    "astrl._compat",
    "astrl.errors",
    "astrl.yaml_data",
    "astrl.jsonl",
    "astrl.locks",
    "astrl._lazy",
    "astrl.argtypes",
    "astrl.decoding",
    "astrl.hub",
    "astrl.names",
    "astrl.backends",
    "astrl.models",
    "astrl.prompts",
    "astrl.scorers",
    "astrl.similarity",
    "astrl.embeddings",
    "astrl.ragged",
    "astrl.lm_scoring",
    "astrl.archive",
    "astrl.keys",
    "astrl.store",
)
LIBRARY = ("astrl.policies", "astrl.prefill", "astrl.envs", "astrl.rewards", "astrl.losses", "astrl.sampling")
APPLICATIONS = (
    "astrl.training",
    "astrl.rollout",
    "astrl.distributed",
    "astrl.cli",
    "astrl.store_cli",
    "astrl.evaluation",
    "astrl.system",
)


def _modules(package: Path = PACKAGE) -> dict[str, Path]:
    modules = {}
    for path in package.rglob("*.py"):
        name = ".".join(path.relative_to(package.parent).with_suffix("").parts).removesuffix(".__init__")
        modules[name] = path
    return modules


def _imports(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the astrl modules it imports (anywhere in the file, function bodies included)."""
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("astrl"):
                for alias in node.names:
                    target = f"{node.module}.{alias.name}"
                    target = target if target in modules else node.module
                    if target in modules and target != name:
                        graph[name].add(target)
            elif isinstance(node, ast.Import):
                graph[name].update(a.name for a in node.names if a.name in modules and a.name != name)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return found


def _package(module: str) -> str:
    """The top-level subpackage of an astrl module (``astrl.training.grpo`` -> ``astrl.training``), or the
    module itself when it is a top-level one (``astrl.cli``)."""
    return ".".join(module.split(".")[:2])


def _package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The module graph with each module collapsed to its :func:`_package`; imports inside a package drop out."""
    packages: dict[str, set[str]] = {}
    for module, targets in graph.items():
        source = _package(module)
        packages.setdefault(source, set()).update(_package(t) for t in targets if _package(t) != source)
    for targets in list(packages.values()):
        for target in targets:
            packages.setdefault(target, set())
    return packages


def _within(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def test_the_cycle_finder_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]


def test_no_module_imports_itself_back_through_others():
    assert _cycles(_imports(_modules())) == []


def test_the_package_graph_finds_a_loop_between_packages_that_the_file_graph_does_not():
    # training.trainer -> system.solvers and system.base -> training.config: no file imports itself back,
    # but the two packages import each other
    graph = {
        "astrl.training.trainer": {"astrl.system.solvers"},
        "astrl.training.config": set(),
        "astrl.system.solvers": {"astrl.system.base"},
        "astrl.system.base": {"astrl.training.config"},
        "astrl.cli": {"astrl.training.trainer"},
    }
    assert _cycles(graph) == []
    assert _package_graph(graph) == {
        "astrl.training": {"astrl.system"},
        "astrl.system": {"astrl.training"},
        "astrl.cli": {"astrl.training"},
    }
    assert _cycles(_package_graph(graph)) == [["astrl.system", "astrl.training"]]


def test_the_package_check_reads_packages_from_files(tmp_path):
    # alpha.high -> beta.low and beta.other -> alpha.base: a loop between the packages, none between the files
    files = {
        "__init__.py": "",
        "alpha/__init__.py": "",
        "alpha/base.py": "",
        "alpha/high.py": "from astrl.beta.low import x\n",
        "beta/__init__.py": "",
        "beta/low.py": "x = 1\n",
        "beta/other.py": "import astrl.alpha.base\n",
    }
    for name, text in files.items():
        (tmp_path / "astrl" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "astrl" / name).write_text(text)
    graph = _imports(_modules(tmp_path / "astrl"))
    assert graph["astrl.alpha.high"] == {"astrl.beta.low"} and graph["astrl.beta.other"] == {"astrl.alpha.base"}
    assert _cycles(graph) == []
    assert _cycles(_package_graph(graph)) == [["astrl.alpha", "astrl.beta"]]


def test_no_package_imports_itself_back_through_others():
    assert _cycles(_package_graph(_imports(_modules()))) == []


def test_ground_floor_and_library_pieces_never_import_the_layers_above_them():
    graph = _imports(_modules())
    upward = [
        (module, target)
        for module, targets in graph.items()
        for target in targets
        if (_within(module, GROUND) and not _within(target, GROUND))
        or (_within(module, LIBRARY) and _within(target, APPLICATIONS))
    ]
    assert upward == []
