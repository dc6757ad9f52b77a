"""Packages found from the tree, never listed by hand (a listed one went missing once).

Everything else is in pyproject.toml; `target_profiles/` and `examples/` live at the top level
and ship as `npuprep.target_profiles` and `npuprep.examples` (package-dir there).
"""

from setuptools import find_packages, setup

setup(
    packages=[
        *find_packages(include=["npuprep", "npuprep.*"]),
        "npuprep.target_profiles",
        "npuprep.examples",
    ]
)
