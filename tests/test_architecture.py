"""The house keeps DESIGN.md's layout: one-way flow between rooms, imports readable from the tree.

The import-linter contracts live in pyproject.toml ([tool.importlinter]). The
rooms install under the one namespace ``tokenprobe`` from top-level folders
(pyproject's package-dir), so the check runs on a copy of the sources laid out
as installed: it sees exactly the files of this checkout, whatever is installed.
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PACKAGE_DIRS: dict[str, str] = PYPROJECT["tool"]["setuptools"]["package-dir"]
# Streamlit runs its script outside any package: the one file that must import by the installed name.
ABSOLUTE_ENTRY_POINTS = {Path("dashboard/streamlit_app.py")}


def installed_layout(destination: Path) -> Path:
    for package, folder in PACKAGE_DIRS.items():
        target = destination.joinpath(*package.split("."))
        target.mkdir(parents=True, exist_ok=True)
        for source in (ROOT / folder).glob("*.py"):
            shutil.copy(source, target / source.name)
    return destination


def lint_imports(tree: Path) -> subprocess.CompletedProcess:
    lint = Path(sys.executable).with_name("lint-imports")
    return subprocess.run([str(lint), "--config", str(ROOT / "pyproject.toml"), "--no-cache"], cwd=tree,
                          env={**os.environ, "PYTHONPATH": str(tree)}, capture_output=True, text=True, timeout=120)


def test_every_package_folder_is_a_package():
    for package, folder in PACKAGE_DIRS.items():
        assert (ROOT / folder / "__init__.py").is_file(), f"{folder}/ ({package}) has no __init__.py"


def test_import_contracts_hold(tmp_path):
    result = lint_imports(installed_layout(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "broken" not in result.stdout.lower() or "0 broken" in result.stdout


def test_an_upstream_import_breaks_the_contract(tmp_path):
    """The check can fail: the store reaching up into the analytics is caught."""
    tree = installed_layout(tmp_path)
    client = tree / "tokenprobe" / "store" / "client.py"
    client.write_text(client.read_text() + "\nfrom ..analytics import pipeline  # an arrow running back up\n")
    result = lint_imports(tree)
    assert result.returncode != 0
    assert "tokenprobe.store is not allowed to import tokenprobe.analytics" in result.stdout


def test_product_imports_are_relative_so_the_tree_alone_resolves_them():
    absolute = []
    for folder in sorted(set(PACKAGE_DIRS.values())):
        for source in (ROOT / folder).glob("*.py"):
            relative = source.relative_to(ROOT)
            if relative in ABSOLUTE_ENTRY_POINTS:
                continue
            for node in ast.walk(ast.parse(source.read_text())):
                names = ([node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else
                         [alias.name for alias in node.names] if isinstance(node, ast.Import) else [])
                absolute += [f"{relative}:{node.lineno} {name}" for name in names
                             if name == "tokenprobe" or name.startswith("tokenprobe.")]
    assert absolute == []



def test_benchmarks_never_import_the_tests():
    """Benchmarks print figures for anyone to run; what they share with the tests lives in refserver/."""
    for source in (ROOT / "benchmarks").glob("*.py"):
        for node in ast.walk(ast.parse(source.read_text())):
            names = ([node.module or ""] if isinstance(node, ast.ImportFrom) else
                     [alias.name for alias in node.names] if isinstance(node, ast.Import) else [])
            assert not any(name == "tests" or name.startswith("tests.") for name in names), source.name
