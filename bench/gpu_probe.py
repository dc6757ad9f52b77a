"""Run the micro-probes in FP16 on an NVIDIA GPU through PyTorch and print the verdicts.

    python bench/gpu_probe.py [--json OUT.json]

Needs torch with CUDA and numpy only (npuprep need not be installed: the repo root is put on
sys.path). Prints a Markdown table per mode (fp16 tensors, and FP32 tensors under autocast).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from npuprep.probe.torch_runner import MODES, run_torch_probes, summary  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the verdicts as JSON here")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("no CUDA device visible to torch", file=sys.stderr)
        return 2
    gpu = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "cpu"
    print(f"device: {gpu}; torch {torch.__version__}; CUDA {torch.version.cuda}")
    doc = {"device": gpu, "torch": torch.__version__, "cuda": torch.version.cuda, "modes": {}}
    for mode in MODES:
        results = run_torch_probes(args.device, mode)
        o = summary(results)
        print(f"\n### mode {mode}: overall {o.verdict} ({o.reason})\n")
        print("| probe | unit | verdict | reference -> observed | why |")
        print("|---|---|---|---|---|")
        for r in results:
            c = r.classification
            pair = f"{c.pairs[0][0]:.6g} -> {c.pairs[0][1]:.6g}" if c.pairs else ""
            verdict = str(c.verdict) + (" (wider)" if c.wider else "")
            print(f"| {r.name} | {r.unit} | {verdict} | {pair} | {c.reason} |")
        doc["modes"][mode] = {"overall": o.to_dict(),
                              "probes": [{"name": r.name, "unit": r.unit, **r.classification.to_dict()}
                                         for r in results]}
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
