"""SIGINT / SIGTERM in the first milliseconds of `npuprep`: how many runs end unclean?

Run: python bench/bench_signal_startup.py [--runs 50] [--max-ms 60] [--signal INT|TERM]
     [--entry script|module]

Each run starts the installed console script (`npuprep`, or `python -m npuprep` with
`--entry module`) on `check` of the bundled example, sleeps a delay spread evenly over
0..max-ms, sends the signal and waits. A run is:
  clean    exit 130/143 with the one line `npuprep: interrupted` / `npuprep: terminated`;
  killed   ended by the signal itself, nothing printed (the signal came before Python set its
           handlers: the shell reports 130/143, as for any program);
  unclean  anything else (a traceback), listed with the innermost frame of the traceback.
Prints one Markdown row per class and, for unclean runs, the delays and where they stopped.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from npuprep.examples import example_model_path


def one_run(command: list[str], delay: float, sig: int, cwd: Path) -> tuple[str, str]:
    command_path = command[0] if len(command) == 1 or command[1] != "-m" else ""
    proc = subprocess.Popen(command, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(delay)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    said = "npuprep: interrupted" if sig == signal.SIGINT else "npuprep: terminated"
    if proc.returncode == 128 + sig and err.strip() == said:
        return "clean", ""
    if proc.returncode == -sig and not err.strip():
        return "killed", ""
    lines = err.splitlines()
    frames = [(i, line.strip()) for i, line in enumerate(lines) if line.strip().startswith("File ")]
    if not frames:
        return "unclean", f"exit {proc.returncode}: {(err.strip().splitlines() or ['(no output)'])[-1]}"
    # The outermost frame says which stage it was: Python's start-up (site) or a line of the
    # console script (`import re`, or the import of npuprep.cli.start), then npuprep itself.
    first, code = frames[0][1], lines[frames[0][0] + 1].strip() if frames[0][0] + 1 < len(lines) else ""
    if not command_path:
        stage = first
    elif first.startswith(f'File "{command_path}"'):
        stage = f"console script {first.split(',')[1].strip()}: {code}"
    else:
        stage = "python start-up (site, .pth files), before the console script"
    return "unclean", f"{stage} (innermost: {frames[-1][1]})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=50)
    ap.add_argument("--max-ms", type=float, default=60.0)
    ap.add_argument("--signal", choices=("INT", "TERM"), default="INT")
    ap.add_argument("--entry", choices=("script", "module"), default="script")
    args = ap.parse_args()
    sig = signal.SIGINT if args.signal == "INT" else signal.SIGTERM
    script = str(Path(sys.executable).with_name("npuprep"))
    command = [script] if args.entry == "script" else [sys.executable, "-m", "npuprep"]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        shutil.copy(example_model_path(), work / "m.onnx")
        command += ["check", "m.onnx", "-t", "generic"]
        results: list[tuple[float, str, str]] = []
        for i in range(args.runs):
            delay = args.max_ms * i / max(args.runs - 1, 1) / 1000
            kind, where = one_run(command, delay, sig, work)
            results.append((delay, kind, where))
    counts = Counter(kind for _, kind, _ in results)
    print(f"| entry | signal | runs | delays | clean | killed | unclean | (python {sys.version.split()[0]},"
          f" pid {os.getpid()})")
    print("|---|---|---|---|---|---|---|")
    print(f"| {args.entry} | SIG{args.signal} | {args.runs} | 0-{args.max_ms:g} ms | {counts['clean']} | "
          f"{counts['killed']} | {counts['unclean']} |")
    for delay, kind, where in results:
        if kind == "unclean":
            print(f"unclean at {delay * 1000:.1f} ms: {where}")
    stages = Counter(where.split(" (innermost")[0] for _, kind, where in results if kind == "unclean")
    for stage, n in stages.most_common():
        print(f"{n} unclean in {stage}")


if __name__ == "__main__":
    main()
