"""`npuprep targets [NAME]`: list the built-in profiles or show one in full."""

from __future__ import annotations

import argparse

from npuprep.cli.common import add_json, out, print_json, print_table

help = "list built-in target profiles, or show one (name or YAML path) in full"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", nargs="?", help="profile name or YAML path to show")
    add_json(p)


def run(args: argparse.Namespace) -> int:
    import yaml

    from npuprep.profiles import builtin_names, load_profile

    if args.name:
        profile = load_profile(args.name)
        if args.json:
            print_json(profile.to_dict())
        else:
            # PyYAML's width is a target it overshoots by a word: 80 keeps the lines within 100.
            print(yaml.safe_dump(profile.to_dict(), sort_keys=False, width=80 if out().width else 10**6), end="")
        return 0
    profiles = [load_profile(n) for n in builtin_names()]
    if args.json:
        print_json([{"name": p.name, "description": p.description, "default_precision": p.default_precision,
                     "overflow": str(p.overflow), "fp32_pinning": str(p.fp32_pinning)} for p in profiles])
        return 0
    print_table(
        "Built-in target profiles",
        ["name", "precision", "overflow", "fp32 pinning", "unsupported", "summary"],
        [(p.name, p.default_precision, str(p.overflow), str(p.fp32_pinning),
          ",".join(p.unsupported_dtypes), p.description) for p in profiles],
    )
    return 0
