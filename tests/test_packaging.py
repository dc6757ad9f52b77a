"""The wheel ships every module the tests import: packages are found from the tree.

tree: npuprep/**/X.py  ->  setup.py's find_packages  ->  the wheel's package list
"""

from __future__ import annotations

from pathlib import Path

from setuptools import find_packages

ROOT = Path(__file__).resolve().parents[1]


def test_every_folder_of_modules_is_a_found_package() -> None:
    folders = {
        ".".join(p.parent.relative_to(ROOT).parts)
        for p in (ROOT / "npuprep").rglob("*.py")
        if "__pycache__" not in p.parts
    }
    found = set(find_packages(str(ROOT), include=["npuprep", "npuprep.*"]))
    assert folders - found == set(), "folders without __init__.py are left out of the wheel"


def test_setup_lists_no_package_by_hand() -> None:
    text = (ROOT / "setup.py").read_text()
    assert "find_packages(include=[\"npuprep\", \"npuprep.*\"])" in text
    assert "packages = [" not in (ROOT / "pyproject.toml").read_text()
