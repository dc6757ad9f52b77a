"""Never lose a user's file (issue 17): every output checked against every input before any
work, outputs written as one set, names treated as data, no traceback on hostile input."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
import yaml
from onnx import TensorProto, helper

from npuprep.errors import NpuprepError
from npuprep.output_files import OutputPlan
from tests.conftest import model_from_text, run_cli

# x -> Mul(x, x) -> Add(., x) -> y: a square that overflows FP16 for |x| > 256.
SQUARE = """<ir_version: 8, opset_import: ["" : 17]>
g (float[2,4] x) => (float[2,4] y) {
  sq = Mul(x, x)
  y = Add(sq, x)
}"""


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _one_line_error(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    return lines[0]


@pytest.fixture(scope="module")
def _workspace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """m.onnx, samples D/000..002.npz, a stats file and a plan, as a user would have them."""
    folder = tmp_path_factory.mktemp("ws")
    onnx.save(model_from_text(SQUARE), folder / "m.onnx")
    (folder / "D").mkdir()
    for i in range(3):
        x = np.random.default_rng(i).uniform(-2, 2, (2, 4)).astype(np.float32)
        np.savez(folder / "D" / f"{i:03d}.npz", x=x)
    assert run_cli("calibrate", "m.onnx", "--data", "D", "-o", "s.json", cwd=folder).returncode == 0
    assert run_cli("convert", "m.onnx", "-t", "a2000", "--stats", "s.json", "--plan-only",
                   "-o", "p.plan.yaml", cwd=folder).returncode == 0
    shutil.copy(folder / "s.json", folder / "o.report.json")  # stats a user named like a report
    return folder


@pytest.fixture
def ws(_workspace: Path, tmp_path: Path) -> Path:
    """A fresh copy of the workspace for one test."""
    return Path(shutil.copytree(_workspace, tmp_path / "ws"))


# ---------------------------------------------------------------- the output plan, in process


def test_dotdot_through_a_missing_folder_is_the_input(tmp_path: Path) -> None:
    (tmp_path / "m.onnx").write_bytes(b"model")
    plan = OutputPlan()
    plan.reads(tmp_path / "m.onnx", "the input model")
    plan.writes(tmp_path / "missingdir" / ".." / "m.onnx", "-o")
    with pytest.raises(NpuprepError, match="refusing to overwrite the input model"):
        plan.check()
    assert not (tmp_path / "missingdir").exists()


def test_symlinks_and_hard_links_are_the_input(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "m.onnx").write_bytes(b"model")
    (tmp_path / "link").symlink_to(tmp_path / "real")
    os.link(tmp_path / "real" / "m.onnx", tmp_path / "hard.onnx")
    (tmp_path / "file_link.onnx").symlink_to(tmp_path / "real" / "m.onnx")
    for out in (tmp_path / "link" / "m.onnx", tmp_path / "hard.onnx", tmp_path / "file_link.onnx",
                tmp_path / "link" / ".." / "real" / "m.onnx"):
        plan = OutputPlan()
        plan.reads(tmp_path / "real" / "m.onnx", "the input model")
        plan.writes(out, "-o")
        with pytest.raises(NpuprepError, match="refusing to overwrite"):
            plan.check()


def test_outputs_clash_with_each_other_and_folders_are_refused(tmp_path: Path) -> None:
    plan = OutputPlan()
    plan.writes(tmp_path / "out.onnx", "-o")
    plan.writes(tmp_path / "x" / ".." / "out.onnx", "--report")
    with pytest.raises(NpuprepError, match="are the same file"):
        plan.check()
    for folder in (tmp_path, f"{tmp_path}/new/"):
        plan = OutputPlan()
        plan.writes(folder, "-o")
        with pytest.raises(NpuprepError, match="is a folder"):
            plan.check()


def test_failure_before_the_last_rename_keeps_the_older_set(tmp_path: Path) -> None:
    a, b = tmp_path / "a.json", tmp_path / "b.md"
    a.write_text("old a")
    b.write_text("old b")
    plan = OutputPlan()
    plan.writes(a, "--report")
    plan.writes(b, "--md")
    with pytest.raises(RuntimeError), plan.open() as files:
        files.text(a, "new a")
        raise RuntimeError("failure between the first file and the second")
    assert (a.read_text(), b.read_text()) == ("old a", "old b")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json", "b.md"]  # no temporaries, no locks


def test_a_signal_during_the_renames_lands_after_the_whole_set(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    import npuprep.output_files as outputs

    paths = [tmp_path / f"{i}.txt" for i in range(3)]
    plan = OutputPlan()
    for p in paths:
        plan.writes(p, "-o")
    real_replace = os.replace

    def replace_then_interrupt(src: Path, dst: Path) -> None:
        real_replace(src, dst)
        os.kill(os.getpid(), signal.SIGINT)

    # Python's own Ctrl-C handler, whatever this process inherited (a job started in the
    # background by a non-interactive shell ignores SIGINT).
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt), plan.open() as files:
            for p in paths:
                files.text(p, p.name)
            monkeypatch.setattr(outputs.os, "replace", replace_then_interrupt)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert [p.read_text() for p in paths] == [p.name for p in paths]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0.txt", "1.txt", "2.txt"]


def test_a_second_run_on_the_same_output_is_refused_and_stale_temporaries_go(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    stale = tmp_path / ".out.json.npuprep-99999999-0badf00d.tmp"  # no such process
    stale.write_text("left by a killed run")
    live = tmp_path / f".out.json.npuprep-{os.getppid()}-0badf00d.tmp"  # a run still going
    live.write_text("being written")
    first = OutputPlan()
    first.writes(out, "-o")
    with first.open() as files:
        assert not stale.exists() and live.read_text() == "being written"
        second = OutputPlan()
        second.writes(tmp_path / "sub" / ".." / "out.json", "-o")
        with pytest.raises(NpuprepError, match="another npuprep run is writing it"), second.open():
            pass
        files.text(out, "first")
    assert out.read_text() == "first"
    with second.open() as files:  # free again once the first run is done
        files.text(out, "second")
    assert out.read_text() == "second"


def test_an_older_weights_file_the_new_model_does_not_use_is_removed(tmp_path: Path) -> None:
    from npuprep.output_files import save_model

    model = model_from_text(SQUARE)
    (tmp_path / "out.onnx.data").write_bytes(b"weights of an older model")
    save_model(model, tmp_path / "out.onnx")
    assert not (tmp_path / "out.onnx.data").exists()
    assert onnx.load(str(tmp_path / "out.onnx")) == model


# ---------------------------------------------------------------- each output flag against each input


def _external_model(folder: Path) -> Path:
    """w (64 floats, external) -> Add(x, w) -> y, saved as em.onnx + em.onnx.data."""
    w = onnx.numpy_helper.from_array(np.ones(64, np.float32), "w")
    g = helper.make_graph([helper.make_node("Add", ["x", "w"], ["y"], name="add")], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [64])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [64])], [w])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    onnx.save_model(m, str(folder / "em.onnx"), save_as_external_data=True, location="em.onnx.data",
                    size_threshold=0)
    return folder / "em.onnx"


CLASHES = [
    ["convert", "m.onnx", "-t", "a2000", "--data", "D", "-o", "missingdir/../m.onnx"],
    ["convert", "m.onnx", "-t", "a2000", "--data", "D", "-o", "o.onnx", "--report", "m.onnx"],
    ["convert", "m.onnx", "-t", "a2000", "--data", "D", "-o", "o.onnx", "--html", "m.onnx"],
    ["convert", "m.onnx", "-t", "a2000", "--data", "D", "-o", "o.onnx", "--report", "o.onnx"],
    ["convert", "m.onnx", "-t", "a2000", "--data", "D", "--plan", "p.plan.yaml", "-o", "p.onnx"],
    ["convert", "m.onnx", "-t", "a2000", "--data", "D", "--stats", "s.json", "-o", "o.onnx",
     "--report", "s.json"],
    ["convert", "m.onnx", "-t", "a2000", "--data", "D", "--stats", "o.report.json", "-o", "o.onnx"],
    ["convert", "m.onnx", "-t", "a2000", "--data", "D", "-o", "D/000.npz"],
    ["convert", "m.onnx", "-t", "a2000", "--data", "D", "-o", "D"],
    ["convert", "m.onnx", "-t", "a2000", "--stats", "s.json", "--plan-only", "-o", "s.json"],
    ["calibrate", "m.onnx", "--data", "D", "-o", "m.onnx"],
    ["calibrate", "m.onnx", "--data", "D", "-o", "D/000.npz"],
    ["check", "m.onnx", "-t", "a2000", "--html", "m.onnx"],
    ["check", "m.onnx", "-t", "a2000", "--stats", "s.json", "--html", "s.json"],
    ["compare", "m.onnx", "--emulate", "-t", "a2000", "--data", "D", "--html", "m.onnx"],
    ["compare", "m.onnx", "--emulate", "-t", "a2000", "--data", "D", "--report", "D/001.npz"],
    ["checklist", "m.onnx", "-t", "a2000", "-o", "m.onnx"],
    ["crosscheck", "m.onnx", "-t", "a2000", "--report", "s.json", "--report-md", "s.json"],
    ["probe", "m.onnx", "-t", "a2000", "--write-profile", "m.onnx"],
    ["probe", "m.onnx", "-t", "a2000", "--export-kit", "."],
    ["report", "s.json", "-o", "s.json"],
]


@pytest.mark.parametrize("argv", CLASHES, ids=[" ".join(a[:1] + a[-2:]) for a in CLASHES])
def test_each_output_flag_against_each_input_exits_2_and_changes_nothing(ws: Path, argv: list[str]) -> None:
    before = _snapshot(ws)
    line = _one_line_error(run_cli(*argv, cwd=ws))
    assert "refusing to overwrite" in line or "same file" in line or "is a folder" in line, line
    assert _snapshot(ws) == before


def test_a_new_file_beside_the_samples_is_not_a_clash_and_can_be_rewritten(ws: Path) -> None:
    for _ in range(2):
        proc = run_cli("calibrate", "m.onnx", "--data", "D", "-o", "D/stats.json", cwd=ws)
        assert proc.returncode == 0, proc.stderr
    assert json.loads((ws / "D" / "stats.json").read_text())["kind"] == "stats"


def test_external_weights_of_the_input_are_inputs(ws: Path) -> None:
    _external_model(ws)
    before = _snapshot(ws)
    line = _one_line_error(run_cli("convert", "em.onnx", "-t", "a2000", "--synthetic", "2",
                                   "-o", "em.onnx.data", cwd=ws))
    assert "external data" in line
    assert _snapshot(ws) == before


def test_read_only_folder_and_file_parent_are_one_line(ws: Path) -> None:
    before = _snapshot(ws)
    line = _one_line_error(run_cli("calibrate", "m.onnx", "--data", "D", "-o", "m.onnx/x.json", cwd=ws))
    assert "not a folder" in line
    if os.geteuid() != 0:  # root writes anywhere: the lock-file attempt below covers it there
        ro = ws / "ro"
        ro.mkdir(mode=0o555)
        line = _one_line_error(run_cli("calibrate", "m.onnx", "--data", "D", "-o", "ro/s.json", cwd=ws))
        assert "not writable" in line
        ro.rmdir()
    assert _snapshot(ws) == before


def test_a_fifo_as_data_or_stats_is_refused_at_once(ws: Path) -> None:
    os.mkfifo(ws / "pipe.npz")
    line = _one_line_error(run_cli("calibrate", "m.onnx", "--data", "pipe.npz", cwd=ws))
    assert "not a regular file" in line
    line = _one_line_error(run_cli("convert", "m.onnx", "-t", "a2000", "--data", "D",
                                   "--stats", "pipe.npz", cwd=ws))
    assert "not a regular file" in line


# ---------------------------------------------------------------- the set on disk


def test_convert_writes_a_set_without_temporaries_and_a_rerun_removes_a_stale_one(ws: Path) -> None:
    (ws / ".o.onnx.npuprep-99999999-deadbeef.tmp").write_bytes(b"left by a SIGKILLed run")
    # The user's own files that look like temporaries: not this tool's names, never swept.
    users = {".o.onnx.mybackup.tmp": b"mine", ".o.report.md.20240101.tmp": b"mine too",
             ".o.onnx.npuprep-deadbeef.tmp": b"no process id: not a name npuprep writes"}
    for name, data in users.items():
        (ws / name).write_bytes(data)
    proc = run_cli("convert", "m.onnx", "-t", "a2000", "--data", "D", "-o", "o.onnx", "--json", cwd=ws)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert {name: (ws / name).read_bytes() for name in users} == users
    names = {p.name for p in ws.iterdir()} - set(users)
    assert not [n for n in names if n.endswith((".tmp", ".lock"))]
    for path in report["artefacts"].values():
        assert (ws / path).is_file(), path
    assert json.loads((ws / "o.report.json").read_text())["output_fingerprint"] == report["output_fingerprint"]


def _convert_then_fail_after_the_model(ws: Path, exc: str) -> subprocess.CompletedProcess[str]:
    """convert with the Markdown writer failing, i.e. after the model and most companions."""
    code = (
        "import sys\n"
        "import npuprep.report.render_md as md\n"
        f"def boom(*a, **k):\n    raise {exc}\n"
        "md.convert_markdown = boom\n"
        "from npuprep.cli.main import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    return subprocess.run([sys.executable, "-c", code, "convert", "m.onnx", "-t", "a2000", "--data", "D",
                           "-o", "o.onnx"], capture_output=True, text=True, cwd=ws, timeout=300)


@pytest.mark.parametrize("exc", ["OSError(28, 'No space left on device')", "KeyboardInterrupt()"])
def test_failure_between_the_model_and_its_companions_keeps_the_older_set(ws: Path, exc: str) -> None:
    assert run_cli("convert", "m.onnx", "-t", "a2000", "--data", "D", "-o", "o.onnx", cwd=ws).returncode == 0
    before = _snapshot(ws)
    proc = _convert_then_fail_after_the_model(ws, exc)
    assert proc.returncode == (130 if "Keyboard" in exc else 1)
    assert _snapshot(ws) == before  # the older model, plan and reports, untouched; no temporaries


def test_sigterm_mid_run_leaves_no_temporaries_and_no_partial_set(ws: Path) -> None:
    # The first sample sleeps, so the signal lands while the command works.
    code = (
        "import sys, time\n"
        "import npuprep.calibrate as cal\n"
        "real = cal.calibrate\n"
        "def slow(*a, **k):\n    print('working', flush=True); time.sleep(30); return real(*a, **k)\n"
        "cal.calibrate = slow\n"
        "from npuprep.cli.main import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    before = _snapshot(ws)
    proc = subprocess.Popen([sys.executable, "-c", code, "convert", "m.onnx", "-t", "a2000", "--data", "D",
                             "-o", "o.onnx"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=ws)
    assert proc.stdout.readline().strip() == "working"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err
    assert "Traceback" not in err
    assert _snapshot(ws) == before


def test_a_concurrent_second_convert_to_the_same_output_is_refused(ws: Path) -> None:
    # The first run holds its outputs until the second has been answered (a file says so):
    # no race with the second run's start-up on a loaded machine.
    code = (
        "import os, sys, time\n"
        "import npuprep.calibrate as cal\n"
        "real = cal.calibrate\n"
        "def slow(*a, **k):\n    print('working', flush=True)\n"
        "    end = time.monotonic() + 120\n"
        "    while not os.path.exists('go') and time.monotonic() < end: time.sleep(0.05)\n"
        "    return real(*a, **k)\n"
        "cal.calibrate = slow\n"
        "from npuprep.cli.main import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    first = subprocess.Popen([sys.executable, "-c", code, "convert", "m.onnx", "-t", "a2000", "--data", "D",
                              "-o", "o.onnx", "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, cwd=ws)
    assert first.stdout.readline().strip() == "working"
    second = run_cli("convert", "m.onnx", "-t", "generic", "--data", "D", "-o", "o.onnx", cwd=ws)
    (ws / "go").touch()
    line = _one_line_error(second)
    assert "another npuprep run is writing it" in line
    out, err = first.communicate(timeout=120)
    (ws / "go").unlink()
    assert first.returncode == 0, err
    report = json.loads(out)
    assert json.loads((ws / "o.report.json").read_text())["target"] == report["target"] == "a2000"


def test_an_older_default_report_is_not_left_beside_the_new_model(ws: Path) -> None:
    (ws / "o.report.json").unlink()
    assert run_cli("convert", "m.onnx", "-t", "a2000", "--data", "D", "-o", "o.onnx", cwd=ws).returncode == 0
    assert (ws / "o.report.json").is_file()
    proc = run_cli("convert", "m.onnx", "-t", "generic", "--data", "D", "-o", "o.onnx", "--report", "r.json",
                   cwd=ws)
    assert proc.returncode == 0, proc.stderr
    assert not (ws / "o.report.json").exists()
    assert json.loads((ws / "r.json").read_text())["target"] == "generic"
    # A file of that name no convert to o.onnx wrote is the user's: kept.
    (ws / "o.report.json").write_text('{"mine": 1}')
    proc = run_cli("convert", "m.onnx", "-t", "generic", "--data", "D", "-o", "o.onnx", "--report", "r.json",
                   cwd=ws)
    assert proc.returncode == 0 and (ws / "o.report.json").read_text() == '{"mine": 1}'
    # Where the default name is an input, it is kept.
    shutil.copy(ws / "s.json", ws / "o.report.json")
    proc = run_cli("convert", "m.onnx", "-t", "generic", "--stats", "o.report.json", "--data", "D",
                   "-o", "o.onnx", "--report", "r.json", cwd=ws)
    assert proc.returncode == 0, proc.stderr
    assert (ws / "o.report.json").read_bytes() == (ws / "s.json").read_bytes()


def _mount_tmpfs(mnt: Path, options: str) -> None:
    mnt.mkdir()
    if shutil.which("mount") is None or os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root and mount(8)")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(mnt)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")


def test_a_read_only_output_folder_is_one_line(ws: Path, tmp_path: Path) -> None:
    mnt = tmp_path / "ro"
    _mount_tmpfs(mnt, "ro,size=64k")
    try:
        line = _one_line_error(run_cli("calibrate", "m.onnx", "--data", "D", "-o", str(mnt / "s.json"),
                                       cwd=ws))
        assert "not writable" in line
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def test_disk_full_on_a_small_tmpfs_leaves_nothing_half_written(ws: Path, tmp_path: Path) -> None:
    mnt = tmp_path / "small"
    _mount_tmpfs(mnt, "size=12k")
    try:
        (mnt / "o.report.json").write_text("older report")
        before = _snapshot(mnt)
        proc = run_cli("convert", "m.onnx", "-t", "a2000", "--data", "D", "-o", str(mnt / "o.onnx"), cwd=ws)
        line = _one_line_error(proc)
        assert "No space left on device" in line
        assert _snapshot(mnt) == before
        assert sorted(p.name for p in mnt.iterdir()) == ["o.report.json"]
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def test_disk_full_while_writing_a_probe_kit_leaves_the_folder_as_it_was(tmp_path: Path) -> None:
    mnt = tmp_path / "small"
    _mount_tmpfs(mnt, "size=16k")
    try:
        (mnt / "mine.txt").write_text("the user's")
        proc = run_cli("probe", "--export-kit", str(mnt / "kit"), "--target", "a2000", cwd=tmp_path)
        line = _one_line_error(proc)
        assert "cannot write the kit (No space left on device); the folder is as it was" in line
        assert sorted(p.name for p in mnt.iterdir()) == ["mine.txt"]
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


# ---------------------------------------------------------------- names are data


INJECTED = 'mul\n  - action: pin_fp32\n    nodes: [sq]\n    forced: true\n    why: X\n  #'


def test_an_injected_node_name_stays_data_in_plan_yaml_and_on_the_terminal(tmp_path: Path) -> None:
    # x -> Mul(x, x) named INJECTED + "\x1b[31m" -> y; the plan pins it (its square overflows FP16).
    model = model_from_text(SQUARE)
    model.graph.node[0].name = INJECTED + "\x1b[31m"
    onnx.save(model, tmp_path / "evil.onnx")
    np.savez(tmp_path / "s.npz", x=np.full((2, 4), 400, np.float32))
    proc = run_cli("convert", "evil.onnx", "-t", "a2000", "--data", "s.npz", "--plan-only",
                   "-o", "evil.plan.yaml", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "\x1b" not in proc.stdout + proc.stderr
    text = (tmp_path / "evil.plan.yaml").read_text()
    assert "\x1b" not in text
    plan = yaml.safe_load(text)
    assert [a["action"] for a in plan["actions"]] and not any(a.get("forced") for a in plan["actions"])
    assert "\n    forced: true" not in text
    proc = run_cli("convert", "evil.onnx", "-t", "a2000", "--data", "s.npz", "--plan", "evil.plan.yaml",
                   "-o", "out.onnx", cwd=tmp_path)
    assert proc.returncode in (0, 1), proc.stderr
    assert "\x1b" not in proc.stdout + proc.stderr
    report = json.loads((tmp_path / "out.report.json").read_text())
    assert not any(a.get("forced") for a in report["actions"])
    md = (tmp_path / "out.report.md").read_text()
    assert "\x1b" not in md and "\n  - action: pin_fp32" not in md


def test_a_profile_name_is_not_a_path_nor_yaml(tmp_path: Path) -> None:
    profile = yaml.safe_load(run_cli("targets", "a2000", cwd=tmp_path).stdout)
    profile["name"] = "/../../../tmp/x\nnode_info: {evil: 1}"
    (tmp_path / "evil.yaml").write_text(yaml.safe_dump(profile))
    onnx.save(model_from_text(SQUARE), tmp_path / "m.onnx")
    np.savez(tmp_path / "s.npz", x=np.full((2, 4), 400, np.float32))
    proc = run_cli("convert", "m.onnx", "-t", "evil.yaml", "--data", "s.npz", cwd=tmp_path)
    assert proc.returncode in (0, 1), proc.stderr
    written = sorted(p.name for p in tmp_path.iterdir() if p.name.endswith(".plan.yaml"))
    assert written == ["m._.._.._.._tmp_x_node_info___evil__1_.plan.yaml"]
    for path in tmp_path.glob("m.*.yaml"):
        data = yaml.safe_load(path.read_text())
        assert "evil" not in json.dumps(data.get("node_info", {})), path


def test_names_module_escapes() -> None:
    from npuprep.names import file_part, md_cell, md_code, shown

    assert shown("a\x1b[31mb\nc") == "a\\x1b[31mb\\nc"
    assert shown("plain\\name") == "plain\\name"
    assert shown("rtl\u202eexe") == "rtl\\u202eexe"
    assert md_code("a`b") == "``a`b``" and md_code("x|y") == "`x\\|y`"
    assert md_cell("<img src=x onerror=alert(1)>|a\n") == "&lt;img src=x onerror=alert(1)>\\|a\\n"
    assert file_part("../..") == "_.." and file_part("") == "out"


# ---------------------------------------------------------------- no traceback


def _run_model(tmp_path: Path, model: onnx.ModelProto, *args: str) -> subprocess.CompletedProcess[str]:
    onnx.save(model, tmp_path / "bad.onnx")
    return run_cli(*args, cwd=tmp_path)


def test_sequence_input_and_undefined_tensor_are_one_line(tmp_path: Path) -> None:
    # s (sequence), x -> SequenceAt(s, 0) + x -> y
    seq = helper.make_tensor_sequence_value_info("s", TensorProto.FLOAT, [2])
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])
    zero = helper.make_node("Constant", [], ["i"], value=helper.make_tensor("v", TensorProto.INT64, [], [0]))
    g = helper.make_graph([zero, helper.make_node("SequenceAt", ["s", "i"], ["a"]),
                           helper.make_node("Add", ["a", "x"], ["y"])], "g", [seq, x], [y])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    line = _one_line_error(_run_model(tmp_path, model, "calibrate", "bad.onnx", "--synthetic", "1"))
    assert "'s' is a sequence" in line
    # x -> Add(x, nope) -> y, where nothing defines `nope`
    g = helper.make_graph([helper.make_node("Add", ["x", "nope"], ["y"], name="add")], "g", [x], [y])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    line = _one_line_error(_run_model(tmp_path, model, "convert", "bad.onnx", "-t", "a2000",
                                      "--synthetic", "1"))
    assert "'nope'" in line


def test_fp16_model_io_converts(tmp_path: Path) -> None:
    # x (fp16) -> Mul -> Add -> y (fp16)
    model = model_from_text(SQUARE.replace("float[", "float16["))
    np.savez(tmp_path / "h.npz", x=np.ones((2, 4), np.float16))
    proc = _run_model(tmp_path, model, "convert", "bad.onnx", "-t", "a2000", "--data", "h.npz", "-o", "h.o.onnx")
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("kind", ["stats", "plan", "report", "crosscheck"])
def test_deep_nesting_is_one_line(ws: Path, kind: str) -> None:
    deep_json = "[" * 5000 + "]" * 5000
    deep_yaml = "a: " + "[" * 5000 + "]" * 5000 + "\n"
    (ws / "deep.json").write_text(deep_json)
    (ws / "deep.yaml").write_text(deep_yaml)
    argv = {
        "stats": ["check", "m.onnx", "-t", "a2000", "--stats", "deep.json"],
        "plan": ["convert", "m.onnx", "-t", "a2000", "--data", "D", "--plan", "deep.yaml", "-o", "o.onnx"],
        "report": ["report", "deep.json", "-o", "r.html"],
        "crosscheck": ["crosscheck", "m.onnx", "-t", "a2000", "--report", "deep.json"],
    }[kind]
    line = _one_line_error(run_cli(*argv, cwd=ws))
    assert "deep" in line


@pytest.mark.parametrize("k", ["10**30", "100"])
def test_plan_k_out_of_range_is_one_line(ws: Path, k: str) -> None:
    plan = yaml.safe_load((ws / "p.plan.yaml").read_text())
    plan["actions"] = [{"action": "rescale", "entry": "node_of_sq", "k": eval(k)}]  # noqa: S307
    (ws / "k.plan.yaml").write_text(yaml.safe_dump(plan))
    line = _one_line_error(run_cli("convert", "m.onnx", "-t", "a2000", "--data", "D", "--plan", "k.plan.yaml",
                                   "-o", "o.onnx", cwd=ws))
    assert "actions[0].k" in line and "out of range" in line


@pytest.mark.parametrize("argv", [
    ["calibrate", "m.onnx", "--synthetic", "2", "--seed", "-1"],
    ["convert", "m.onnx", "-t", "a2000", "--data", "D", "--rtol", "nan"],
    ["convert", "m.onnx", "-t", "a2000", "--data", "D", "--rtol", "-1"],
    ["compare", "m.onnx", "--emulate", "-t", "a2000", "--data", "D", "--atol", "inf"],
    ["compare", "m.onnx", "--emulate", "-t", "a2000", "--data", "D", "--tol", "y:nan"],
])
def test_bad_numbers_are_refused(ws: Path, argv: list[str]) -> None:
    before = _snapshot(ws)
    proc = run_cli(*argv, cwd=ws)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert _snapshot(ws) == before


def test_io_types_target_on_the_zoo(tmp_path: Path) -> None:
    from examples.zoo import ZOO
    from npuprep.calibrate import calibrate
    from npuprep.convert import convert
    from npuprep.data import load_samples
    from npuprep.model_io import load_model
    from npuprep.profiles import load_profile
    from npuprep.runtime.session import make_session

    profile = load_profile("generic")
    for name, make in ZOO.items():
        z = make(n_samples=2)
        onnx.save(z.model, tmp_path / f"{name}.onnx")
        (tmp_path / name).mkdir()
        for i, feed in enumerate(z.samples):
            np.savez(tmp_path / name / f"{i}.npz", **feed)
        model = load_model(tmp_path / f"{name}.onnx")
        samples = load_samples(tmp_path / name, model.proto)
        result = convert(model, profile, list(samples), stats=calibrate(model, samples), io_types="target")
        lowered = result.lowered.model
        make_session(lowered)  # loads: no duplicate names
        io = list(lowered.graph.input) + list(lowered.graph.output)
        floats = [vi for vi in io if vi.type.tensor_type.elem_type in (TensorProto.FLOAT, TensorProto.FLOAT16)]
        assert floats and all(vi.type.tensor_type.elem_type == TensorProto.FLOAT16 for vi in floats), name


def test_sigint_during_calibrate_streams_exits_130_not_134(tmp_path: Path) -> None:
    # x[64,1024] -> 24 x MatMul(., w) -> h23: slow enough (~5 s) that Ctrl-C lands while
    # onnxruntime's threads run (the issue saw "terminate called without an active exception").
    rng = np.random.default_rng(0)
    w = onnx.numpy_helper.from_array((rng.standard_normal((1024, 1024)) / 32).astype(np.float32), "w")
    nodes = [helper.make_node("MatMul", ["x" if i == 0 else f"h{i - 1}", "w"], [f"h{i}"]) for i in range(24)]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [64, 1024])],
                          [helper.make_tensor_value_info("h23", TensorProto.FLOAT, [64, 1024])], [w])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), tmp_path / "big.onnx")
    np.savez(tmp_path / "b.npz", x=rng.standard_normal((60, 64, 1024)).astype(np.float32))
    proc = subprocess.Popen([sys.executable, "-m", "npuprep", "calibrate", "big.onnx", "--data", "b.npz",
                             "--batched", "--streams", "2", "-o", "s.json"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=tmp_path, start_new_session=True)
    time.sleep(3)
    os.killpg(proc.pid, signal.SIGINT)  # as Ctrl-C does: the whole process group
    _, err = proc.communicate(timeout=60)
    # 0: it finished first; -2: the signal came during interpreter teardown, after the outputs.
    assert proc.returncode in (0, 130, -2), err
    assert "Traceback" not in err and "terminate called" not in err
    assert not [p for p in tmp_path.iterdir() if p.name.endswith((".tmp", ".lock"))]
    # Interrupted before its outputs landed: none; after (the closing lines, on a loaded
    # machine): the whole file, as written at once.
    if (tmp_path / "s.json").exists():
        assert json.loads((tmp_path / "s.json").read_text())["tensors"]
