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
        if name in ("_widgets", "_magics"):
            continue
        source = Path(importlib.import_module(f"mgkit.{name}").__file__).read_text()
        assert not re.search(r"^\s*(import|from)\s+(ipywidgets|matplotlib|IPython)", source, re.M), name


@pytest.mark.parametrize("module", [*MODULES, "__init__"])
def test_docstring_examples_run(module):
    mod = mg if module == "__init__" else importlib.import_module(f"mgkit.{module}")
    result = doctest.testmod(mod, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0
