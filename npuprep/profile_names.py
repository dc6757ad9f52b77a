"""Where the built-in target profiles live and their names (no heavy imports: the CLI's
help text lists them before anything else is loaded)."""

from __future__ import annotations

from pathlib import Path


def builtin_dir() -> Path:
    """Folder of the built-in profiles, installed (inside the package) or in a checkout."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "target_profiles", here.parent / "target_profiles"):
        if (candidate / "generic.yaml").is_file():
            return candidate
    raise RuntimeError("built-in target profiles are missing from the installation")


def builtin_names() -> list[str]:
    return sorted(p.stem for p in builtin_dir().glob("*.yaml"))
