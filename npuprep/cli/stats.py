"""`npuprep stats merge a.json b.json ... -o all.json`: stats over disjoint samples merged exactly."""

from __future__ import annotations

import argparse
from pathlib import Path

from npuprep.cli.common import add_json, into_folder, print_json
from npuprep.names import shown

help = "work with stats files: merge the stats of shards (npuprep calibrate --shard K/N) into one"


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="stats_command", metavar="ACTION", required=True)
    merge = sub.add_parser(
        "merge", help="merge stats files over disjoint samples of one model into the stats of all of them",
        description="Merge stats files over disjoint samples of one model (shards) exactly: the result "
                    "equals one calibration over all their samples.")
    merge.add_argument("files", nargs="+", help="stats files (npuprep calibrate -o), one per shard")
    merge.add_argument("-o", "--output", required=True, help="write the merged statistics here")
    add_json(merge)


def run(args: argparse.Namespace) -> int:
    from npuprep.calibrate.merge import merge_stats
    from npuprep.calibrate.stats import SCHEMA_VERSION, dump_stats, read_stats_doc, stats_from_dict
    from npuprep.output_files import OutputPlan

    out = Path(into_folder(args.output, "merged.stats.json") or args.output)
    outputs = OutputPlan()
    for f in args.files:
        outputs.reads(f, "a stats file to merge")
    outputs.writes(out, "-o")
    with outputs.open() as files:
        parts = [(f, stats_from_dict(read_stats_doc(f, (SCHEMA_VERSION,)), f)) for f in args.files]
        merged = merge_stats(parts)
        files.text(out, dump_stats(merged))
    if args.json:
        print_json({"output": str(out), "files": list(args.files), "sample_count": merged.sample_count,
                    "tensors": len(merged.tensors), "fingerprint": merged.fingerprint})
    else:
        print(f"merged {len(parts)} files: {shown(merged.samples)}, {len(merged.tensors)} tensors "
              f"-> {shown(out)}")
    return 0
