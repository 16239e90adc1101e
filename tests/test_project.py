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


def _package_imports() -> dict[str, set[str]]:
    """Module -> the package's modules it imports (at the top or inside a function), read from
    the source: ``mgkit._ledger`` -> {``mgkit._contexts``, ...}; the package root is ``mgkit``."""
    import ast

    root = Path(mg.__path__[0])
    graph: dict[str, set[str]] = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        found = graph.setdefault(name, set())
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names if a.name.split(".")[0] == "mgkit"}
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                    target = f"{base}.{node.module}" if node.module else base
                else:
                    target = node.module or ""
                if target.split(".")[0] != "mgkit":
                    continue
                for alias in node.names:  # `from . import _contexts` names a module
                    sub = f"{target}.{alias.name}"
                    found.add(
                        sub
                        if (root.parent / Path(*sub.split("."))).exists()
                        or (root.parent / Path(*sub.split("."))).with_suffix(".py").exists()
                        else target
                    )
        found.discard(name)
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
