"""The package's layers: imports flow one way, engine -> runner -> models -> sample / ops -> base.

Every import counts, at module level or inside a function: a lazy import is a
dependency all the same.
"""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
# Where each installed package's files are (models/ and ops/ sit at the top level).
PACKAGE_DIRS = {"jaxrunner": ROOT / "jaxrunner", "jaxrunner.models": ROOT / "models", "jaxrunner.ops": ROOT / "ops"}
# Lower rank is lower in the stack; a module imports only its own rank or below.
FRONT, ENGINE, RUNNER, MODELS, KERNELS, BASE = 5, 4, 3, 2, 1, 0
BASE_MODULES = {"config", "interfaces", "compat", "envs", "sharding", "spans", "lora"}


def _rank(module: str) -> int:
    parts = module.split(".")[1:]
    if not parts:
        return FRONT  # the package itself: the public front, LLM and SamplingParams
    head = parts[0]
    if head in BASE_MODULES:
        return BASE
    return {
        "engine": ENGINE,
        "runner": RUNNER,
        "models": MODELS,
        "multimodal": MODELS,  # images read and preprocessed for the models, beside them
        "sample": KERNELS,
        "ops": KERNELS,
    }.get(head, FRONT)  # cli, launch, __main__


def _modules() -> dict[str, pathlib.Path]:
    found = {}
    for package, folder in PACKAGE_DIRS.items():
        for path in folder.rglob("*.py"):
            relative = path.relative_to(folder).with_suffix("")
            parts = [p for p in relative.parts if p != "__init__"]
            if package == "jaxrunner" and parts and parts[0] in ("models", "ops"):
                continue
            found[".".join([package, *parts])] = path
    return found


MODULES = _modules()


def _imports(module: str, path: pathlib.Path) -> set[str]:
    is_package = path.name == "__init__.py"
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")[: len(module.split(".")) - node.level + is_package]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:  # a submodule by name, else a name from the module
                names.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base)
    return {n for n in names if n.split(".")[0] == "jaxrunner"}


GRAPH = {m: {i for i in _imports(m, p) if i in MODULES and i != m} for m, p in MODULES.items()}


def test_the_layers_are_folders():
    for folder in ("engine", "runner", "sample"):
        assert (ROOT / "jaxrunner" / folder / "__init__.py").exists()
    assert not (ROOT / "jaxrunner" / "models").exists() and not (ROOT / "jaxrunner" / "ops").exists()


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_upward_import(module):
    upward = sorted(i for i in GRAPH[module] if _rank(i) > _rank(module))
    assert not upward, f"{module} imports from a layer above it: {upward}"


def test_sample_and_ops_do_not_import_each_other():
    crossing = [
        (m, i)
        for m, deps in GRAPH.items()
        for i in deps
        if _rank(m) == _rank(i) == KERNELS and m.split(".")[1] != i.split(".")[1]
    ]
    assert not crossing


def test_no_import_cycle():
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for dep in sorted(GRAPH[module]):
            if state.get(dep) == 1:
                cycle = path[path.index(dep) :] + [dep] if dep in path else [module, dep]
                raise AssertionError(f"import cycle: {' -> '.join(cycle)}")
            if dep not in state:
                visit(dep, path + [dep])
        state[module] = 2

    for module in sorted(MODULES):
        if module not in state:
            visit(module, [module])


def test_a_broken_layering_is_caught():
    """The checks above read real imports: an upward import written into a module's source is seen."""
    module = "jaxrunner.ops.attention"
    source = MODULES[module].read_text() + "\nfrom jaxrunner.runner.model_runner import ModelRunner\n"
    tree_imports = {
        n
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.ImportFrom)
        for n in [node.module or ""]
        if n.startswith("jaxrunner")
    }
    assert any(_rank(i) > _rank(module) for i in tree_imports)
