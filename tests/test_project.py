"""The project's shape: dependency lists agree, README and CI run the same test command,
the version comes from package metadata, docstring examples run (`mgkit tour`: tests/test_cli.py)."""

import doctest
import importlib
import importlib.metadata
import pkgutil
import re
import tomllib
from pathlib import Path

import pytest
import yaml

import mgkit as mg

ROOT = Path(__file__).resolve().parent.parent


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~\[; ]", requirement.strip(), maxsplit=1)[0].lower()


def test_environment_yml_matches_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = set(project["dependencies"]) | set(project["optional-dependencies"]["test"])
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    listed = {p for p in pip if not p.startswith("-e")}
    assert listed == wanted, (
        f"only in environment.yml: {listed - wanted}; only in pyproject: {wanted - listed}"
    )
    python = next(d for d in env["dependencies"] if isinstance(d, str) and d.startswith("python"))
    assert python.replace("python", "") == project["requires-python"]


def test_readme_test_command_is_what_ci_runs():
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```(?:bash|sh)\n(.*?)```", readme, re.S)
    assert len(blocks) >= 2, "the README starts with two command blocks: set up + tour, and the tests"
    setup, tests = (b.strip() for b in blocks[:2])
    assert "mgkit tour" in setup
    ci = (ROOT / ".ci" / "run").read_text()
    assert tests in ci, f"README's test command {tests!r} is not in .ci/run"
    assert readme.index(setup) < readme.index("##"), "the two commands come first in the README"


def test_version_comes_from_metadata():
    assert mg.__version__ == importlib.metadata.version("mgkit")


def test_public_names_are_listed_once():
    assert sorted(mg.__all__) == sorted(set(mg.__all__))
    for name in mg.__all__:
        assert getattr(mg, name) is not None


# every module of the package, subpackages' included: "logreg", "logreg._fit", ...
MODULES = sorted(m.name.removeprefix("mgkit.") for m in pkgutil.walk_packages(mg.__path__, "mgkit."))


def test_compute_modules_never_import_widget_code():
    for name in MODULES:
        # the view layer, and a training History's plot(), a summary that draws only when asked
        if name in ("views._base", "views._png", "_magics", "train._history"):
            continue
        source = Path(importlib.import_module(f"mgkit.{name}").__file__).read_text()
        assert not re.search(r"^\s*(import|from)\s+(ipywidgets|matplotlib|IPython)", source, re.M), name


@pytest.mark.parametrize("module", [*MODULES, "__init__"])
def test_docstring_examples_run(module):
    mod = mg if module == "__init__" else importlib.import_module(f"mgkit.{module}")
    result = doctest.testmod(mod, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0


def _sources() -> dict[str, Path]:
    """Module name -> its file, for every module of the package (``mgkit._ledger._events``)."""
    root = Path(mg.__path__[0])
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(module: str, path: Path, sources: dict[str, Path]):
    """The package's imports in one module (at the top or inside a function), read from the
    source: ``(module imported, name taken from it or None, the name it is bound to)``;
    ``from . import _contexts`` imports the module ``mgkit._contexts``."""
    import ast

    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "mgkit":
                    yield a.name, None, a.asname or a.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module or ""
            if target.split(".")[0] != "mgkit":
                continue
            for a in node.names:
                sub = f"{target}.{a.name}"
                yield (
                    (sub, None, a.asname or a.name)
                    if sub in sources
                    else (target, a.name, a.asname or a.name)
                )


def _package_imports() -> dict[str, set[str]]:
    """Module -> the package's modules it imports: ``mgkit._ledger`` -> {``mgkit._contexts``, ...};
    the package root is ``mgkit``."""
    sources = _sources()
    graph = {}
    for module, path in sources.items():
        graph[module] = {target for target, _, _ in _imports(module, path, sources)} - {module}
    return graph


def test_no_module_imports_the_package_root():
    """Inside the package, names come from the module that defines them, never through
    ``mgkit/__init__.py`` (which imports everything: a module importing it runs in a half-made package)."""
    offenders = {m for m, deps in _package_imports().items() if m != "mgkit" and "mgkit" in deps}
    assert not offenders, f"these modules import the package root: {sorted(offenders)}"


def test_package_imports_have_no_cycle():
    graph = {m: deps - {"mgkit"} for m, deps in _package_imports().items() if m != "mgkit"}
    state: dict[str, int] = {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for d in sorted(graph.get(m, ())):
            if state.get(d) == 1:
                cycle = [*path[path.index(d) :], d] if d in path else [m, d]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if d not in state:
                visit(d, [*path, d])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def test_no_module_is_over_600_lines():
    long = {m: n for m, p in _sources().items() if (n := len(p.read_text().splitlines())) > 600}
    assert not long, f"modules over 600 lines (split them by question): {long}"


def test_no_function_is_over_80_lines():
    """Counted without its docstring."""
    import ast

    long = {}
    for module, path in _sources().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            lines = node.end_lineno - node.lineno + 1
            if ast.get_docstring(node, clean=False) is not None:
                doc = node.body[0]
                lines -= doc.end_lineno - doc.lineno + 1
            if lines > 80:
                long[f"{module}.{node.name}"] = lines
    assert not long, f"functions over 80 lines: {long}"


def test_no_module_reaches_into_another_modules_private_names():
    """No ``from .other import _name``, no ``other_module._name``, and a private module is
    imported only from inside its own package (``mgkit.launching._result`` only from
    ``mgkit.launching``; ``mgkit._ledger`` from anywhere in ``mgkit``)."""
    import ast

    sources = _sources()
    found = []
    for module, path in sources.items():
        modules_bound = set()  # local names bound to one of the package's modules
        for target, name, bound in _imports(module, path, sources):
            if name is None:
                modules_bound.add(bound)
            elif _private(name):
                found.append(f"{module}: from {target} import {name}")
            parts = target.split(".")
            for i, part in enumerate(parts[1:], 1):
                owner = ".".join(parts[:i])
                if _private(part) and not (module == owner or module.startswith(owner + ".")):
                    found.append(f"{module}: imports {target}, private to {owner}")
                    break
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in modules_bound
                and _private(node.attr)
            ):
                found.append(f"{module}: {node.value.id}.{node.attr}")
    assert not found, "reaching into private names:\n" + "\n".join(sorted(set(found)))
