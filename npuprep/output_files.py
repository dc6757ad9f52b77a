"""Every file a command writes, checked against every file it reads before any work, then
written as one set.

    plan = OutputPlan(); plan.reads_model(m); plan.writes(out, "-o")   # declare
    with plan.open() as files:      # clash, folder, unwritable, busy -> one line, exit 2
        ...work...; files.text(out, text)   # staged as .NAME.npuprep-XXXXXXXX.tmp, fsynced
    # leaving the block renames the set into place; an error or signal removes the temporaries

Paths are compared after `realpath` (symlinks followed, `..` applied through folders that do
not exist yet, as they will once created) and by inode where both exist (hard links).
Each output is locked (`.NAME.lock` beside it) for the whole run, so a second run aimed at
it refuses at once instead of interleaving; temporaries a killed run left are removed then.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import fnmatch
import os
import re
import secrets
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import onnx

from npuprep.errors import NpuprepError
from npuprep.formatting import shorten
from npuprep.model_io import external_locations, light_proto, write_bytes, write_model_files
from npuprep.names import shown

_TEMP_MARK = ".npuprep-"
# The files a command reads inside a --data folder and a checklist --workspace.
SAMPLE_FILES = ("*.npz",)
WORKSPACE_FILES = ("*.json", "*.yaml")


def resolve(path: str | os.PathLike[str]) -> Path:
    """The absolute path `path` names once its missing folders exist: symlinks followed,
    `..` applied to the folder before it (`missing/../m.onnx` is `m.onnx`)."""
    return Path(os.path.realpath(os.path.abspath(os.fspath(path))))


def temp_name(final: Path) -> Path:
    """A temporary beside `final` that stale-temporary cleaning recognises as its own: the
    marker, the writing process's id and 8 random hex digits."""
    return final.parent / f".{final.name}{_TEMP_MARK}{os.getpid()}-{secrets.token_hex(4)}.tmp"


def stale_temporaries(final: Path) -> list[Path]:
    """Temporaries for `final` that a run which has ended left behind: only names
    `temp_name` makes (never a user's `.out.onnx.mybackup.tmp`), of a process gone."""
    pattern = re.compile(re.escape(f".{final.name}{_TEMP_MARK}") + r"(\d+)-[0-9a-f]{8}\.tmp")
    try:
        names = os.listdir(final.parent)
    except OSError:
        return []
    found = []
    for name in names:
        match = pattern.fullmatch(name)
        if match and not _alive(int(match.group(1))):
            found.append(final.parent / name)
    return sorted(found)


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):
        return False
    except PermissionError:
        return True  # another user's live process
    return True


def _check_name_lengths(out: _Entry, existing: Path) -> None:
    """Every name in the path fits the file system, the temporary staged beside the file too
    (its name is about 30 bytes longer)."""
    try:
        limit = os.pathconf(existing, "PC_NAME_MAX")
    except (OSError, ValueError):
        limit = 255
    names = [*out.real.parts[1:-1], temp_name(out.real).name if not out.folder else out.real.name]
    longest = max(names, key=lambda n: len(os.fsencode(n)))
    if len(os.fsencode(longest)) > limit:
        raise NpuprepError(f"{out.what} {shorten(shown(out.path), 60)}: a name in it is too long for the file system "
                           f"({len(os.fsencode(longest))} bytes with npuprep's temporary suffix, at most "
                           f"{limit}); choose a shorter one")


class WriteError(NpuprepError):
    """A staged output could not be written (a full disk, a lost mount): nothing was put in
    place. `strerror` is the system's reason, for callers that name the file their own way."""

    def __init__(self, path: str, exc: OSError) -> None:
        self.strerror = str(exc.strerror or exc)
        super().__init__(f"{path}: cannot write ({self.strerror}); no file of this run was put in place")


def _exists(path: Path) -> bool:
    try:
        return path.exists()
    except OSError:  # a name in it too long: _check_name_lengths says which
        return False


def _same(a: Path, b: Path) -> bool:
    if a == b:
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


@dataclass
class _Entry:
    path: Path  # as the user gave it, for messages
    real: Path
    what: str
    optional: bool = False  # removed at the end when this run does not write it (stale companion)
    folder: bool = False
    stale: bool = False  # only ever removed: dropped where it is also an input or another output
    trailing_sep: bool = False  # given as `name/`: meant as a folder
    patterns: tuple[str, ...] = ()  # a folder input: the names the command reads in it


@dataclass
class OutputPlan:
    """The paths one command reads and writes; `open()` checks them and returns the writer."""

    inputs: list[_Entry] = field(default_factory=list)
    outputs: list[_Entry] = field(default_factory=list)

    def reads(self, path: str | os.PathLike[str] | None, what: str, patterns: tuple[str, ...] = ("*",)) -> None:
        """An input file or folder; a folder's files that match `patterns` (those the command
        reads there) are inputs too."""
        if not path:
            return
        real = resolve(path)
        if real.exists() and not (real.is_file() or real.is_dir()):
            # Reading a FIFO or a device blocks or never ends.
            raise NpuprepError(f"{what} {shown(path)}: not a regular file or folder")
        self.inputs.append(_Entry(Path(path), real, what, folder=real.is_dir(), patterns=patterns))
        if real.is_dir():
            try:
                children = sorted({c for pattern in patterns for c in real.glob(pattern)})
            except OSError:
                children = []
            for child in children:
                if child.is_file():
                    self.inputs.append(_Entry(Path(path) / child.name, resolve(child),
                                              f"a file of {what} {shown(path)}"))

    def reads_profile(self, target: str | None) -> None:
        """`--target`: a user's profile file is an input; a built-in name is not a path."""
        if target and Path(target).is_file():
            self.reads(target, "the --target profile")

    def reads_model(self, path: str | os.PathLike[str] | None, what: str = "the input model") -> None:
        """A model and the external-data files it names."""
        if not path:
            return
        self.reads(path, what)
        try:
            locations = external_locations(light_proto(path))
        except Exception:  # noqa: BLE001 - an unreadable model is reported by load_model
            return
        for loc in sorted(locations):
            self.reads(Path(path).parent / loc, f"the external data of {what} {path}")

    def writes(self, path: str | os.PathLike[str], what: str, *, optional: bool = False) -> Path:
        """An output file; `optional`: a companion this run may not write, whose older copy
        is then removed so it is not taken for part of the new set."""
        self.outputs.append(_Entry(Path(path), resolve(path), what, optional=optional,
                                   trailing_sep=os.fspath(path).endswith(("/", os.sep))))
        return Path(path)

    def removes_stale(self, path: str | os.PathLike[str], what: str) -> None:
        """A companion of an older run that this run writes elsewhere (a default report name
        when --report names another file): removed so it is not taken for part of the new
        set, unless the command reads it or writes it anyway."""
        self.outputs.append(_Entry(Path(path), resolve(path), what, optional=True, stale=True))

    def writes_model(self, path: str | os.PathLike[str], what: str) -> Path:
        """A model output and its possible external-data file `<name>.data`."""
        self.writes(path, what)
        self.writes(f"{path}.data", f"the weights file of {what}", optional=True)
        return Path(path)

    def writes_folder(self, path: str | os.PathLike[str], what: str) -> Path:
        """A folder a command fills (a probe kit): no input may lie inside it."""
        self.outputs.append(_Entry(Path(path), resolve(path), what, folder=True))
        return Path(path)

    def check(self) -> None:
        """One NpuprepError for the first problem: an output that is an input, lies in an
        output folder with an input, is named twice, is a folder, or cannot be written."""
        self.outputs = [o for o in self.outputs if not (o.stale and self._taken(o))]
        for i, out in enumerate(self.outputs):
            self._check_one(out)
            for other in self.outputs[:i]:
                if _same(out.real, other.real) or (other.folder and out.real.is_relative_to(other.real)):
                    raise NpuprepError(f"{out.what} {shown(out.path)} and {other.what} {shown(other.path)} "
                                       "are the same file; choose different paths")

    def _taken(self, stale: _Entry) -> bool:
        others = [e for e in self.outputs if e is not stale] + self.inputs
        return not stale.real.is_file() or any(_same(stale.real, e.real) for e in others)

    def _check_one(self, out: _Entry) -> None:
        name = shown(out.path)
        for inp in self.inputs:
            if _same(out.real, inp.real) or (out.folder and inp.real.is_relative_to(out.real)):
                same = "" if out.path == inp.path else f" (which is {shown(inp.path)})"
                raise NpuprepError(f"{out.what} {name}{same}: refusing to overwrite {inp.what}, which this "
                                   "command reads; choose another path")
        for inp in self.inputs:
            if inp.folder and out.real.parent == inp.real and not out.folder and any(
                    fnmatch.fnmatchcase(out.real.name, p) for p in inp.patterns):
                # The next run would read it as one of them (a model written as a sample).
                raise NpuprepError(f"{out.what} {name}: lies in {inp.what} {shown(inp.path)}, where "
                                   f"every {' or '.join(inp.patterns)} file is read; choose another path")
        parent = out.real if out.folder else out.real.parent
        while not _exists(parent):
            parent = parent.parent
        # First: a name too long makes every look at the path an OSError.
        _check_name_lengths(out, parent)
        if out.folder:
            if out.real.exists() and not out.real.is_dir():
                raise NpuprepError(f"{out.what} {name}: exists and is not a folder")
        elif out.trailing_sep or out.real.is_dir():
            raise NpuprepError(f"{out.what} {name}: is a folder; give a file name")
        elif out.real.exists() and not out.real.is_file():
            raise NpuprepError(f"{out.what} {name}: exists and is not a regular file")
        if not parent.is_dir():
            raise NpuprepError(f"{out.what} {name}: {shown(parent)} is a file, not a folder")
        if not os.access(parent, os.W_OK | os.X_OK):
            raise NpuprepError(f"{out.what} {name}: folder {shown(parent)} is not writable")

    @contextmanager
    def open(self) -> Iterator[OutputSet]:
        """Check, create missing folders, lock every output and clean its stale temporaries;
        the set yielded is renamed into place when the block ends without an error."""
        self.check()
        files = OutputSet(self.outputs)
        try:
            files.lock()
            yield files
            files.commit()
        finally:
            files.discard()


class OutputSet:
    """Staged outputs: written to temporaries beside their targets, renamed together."""

    def __init__(self, outputs: list[_Entry]) -> None:
        self._outputs = {e.real: e for e in outputs if not e.folder}
        self._staged: dict[Path, Path] = {}  # final -> temporary
        self._locks: list[tuple[Path, int]] = []
        self._last: set[Path] = set()
        # Folders lock made, deepest first: a run that writes nothing leaves none behind.
        self._made: list[Path] = []

    def lock(self) -> None:
        for real in sorted(self._outputs):
            missing = [p for p in (real.parent, *real.parent.parents) if not p.exists()]
            try:
                real.parent.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise NpuprepError(f"{shown(self._outputs[real].path)}: cannot create its folder "
                                   f"({exc.strerror})") from None
            self._made += missing
            self._locks.append(_acquire(real, self._outputs[real]))
            for stale in stale_temporaries(real):
                stale.unlink(missing_ok=True)

    def _final(self, path: str | os.PathLike[str]) -> Path:
        real = resolve(path)
        if real not in self._outputs:
            raise ValueError(f"{path} was not declared as an output")
        return real

    def bytes(self, path: str | os.PathLike[str], data: bytes) -> Path:
        """Stage `data` for `path`."""
        final = self._final(path)
        self._write(final, lambda tmp: write_bytes(tmp, data))
        return Path(path)

    def text(self, path: str | os.PathLike[str], text: str) -> Path:
        return self.bytes(path, text.encode("utf-8"))

    def model(self, proto: onnx.ModelProto, path: str | os.PathLike[str], *, external_data: bool | None = None) -> Path:
        """Stage a model (and its weights file when it needs one); the model is renamed last."""
        final = self._final(path)
        data_final = final.parent / (final.name + ".data")
        temps = {final: temp_name(final), data_final: temp_name(data_final)}
        self._staged.update(temps)  # registered first, so a failure removes both
        try:
            written = write_model_files(proto, temps[final], temps[data_final], data_final.name,
                                        external_data=external_data)
        except OSError as exc:
            raise WriteError(shown(path), exc) from None
        if not written:
            temps[data_final].unlink(missing_ok=True)
            del self._staged[data_final]
        elif data_final not in self._outputs:
            raise ValueError(f"{data_final} was not declared as an output (use writes_model)")
        self._last.add(final)
        return Path(path)

    def _write(self, final: Path, write: Callable[[Path], None]) -> None:
        tmp = temp_name(final)
        self._staged[final] = tmp
        try:
            write(tmp)
        except OSError as exc:
            raise WriteError(shown(self._outputs[final].path), exc) from None

    def commit(self) -> None:
        """Rename every staged file into place (models last), with SIGINT/SIGTERM deferred
        so the set is never half renamed; then remove older optional companions."""
        order = sorted(self._staged, key=lambda p: p in self._last)
        with _signals_deferred():
            folders = set()
            done = 0
            for final in order:
                try:
                    os.replace(self._staged[final], final)
                except OSError as exc:
                    raise NpuprepError(f"{shown(self._outputs[final].path)}: cannot put it in place "
                                       f"({exc.strerror or exc}); {done} of {len(order)} files of this "
                                       "run were") from None
                del self._staged[final]
                done += 1
                folders.add(final.parent)
            for real, entry in self._outputs.items():
                if entry.optional and real not in order and real.is_file():
                    real.unlink()
                    folders.add(real.parent)
            for folder in folders:
                _fsync_folder(folder)

    def discard(self) -> None:
        """Remove what was not renamed and release the locks."""
        for tmp in self._staged.values():
            tmp.unlink(missing_ok=True)
        self._staged.clear()
        for lock_path, fd in reversed(self._locks):
            lock_path.unlink(missing_ok=True)
            os.close(fd)
        self._locks.clear()
        for folder in sorted(self._made, key=lambda p: len(p.parts), reverse=True):
            with contextlib.suppress(OSError):  # not empty: it holds what was written
                folder.rmdir()
        self._made.clear()


@contextmanager
def _signals_deferred() -> Iterator[None]:
    """SIGINT and SIGTERM that arrive inside the block take effect when it ends. (Blocking
    them in this thread would not do: another thread, onnxruntime's, may receive them.)"""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    kinds = (signal.SIGINT, signal.SIGTERM)
    previous = {s: signal.signal(s, lambda signum, frame: caught.append(signum)) for s in kinds}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        if caught:
            signal.raise_signal(caught[0])


def _acquire(real: Path, entry: _Entry) -> tuple[Path, int]:
    """An exclusive lock on `.NAME.lock` beside `real`; refused while another run holds it."""
    lock_path = real.parent / f".{real.name}.lock"
    while True:
        try:
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise NpuprepError(f"{entry.what} {shown(entry.path)}: cannot create {shown(lock_path)} "
                               f"({exc.strerror}); is the folder writable?") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise NpuprepError(f"{entry.what} {shown(entry.path)}: another npuprep run is writing "
                                   "it now; wait for it to finish or choose another path") from None
            raise
        # The holder before us may have removed the lock file after we opened it: retry on the new one.
        try:
            if os.fstat(fd).st_ino == os.stat(lock_path).st_ino:
                return lock_path, fd
        except FileNotFoundError:
            pass
        os.close(fd)


def _fsync_folder(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def save_model(
    proto: onnx.ModelProto,
    path: str | Path,
    *,
    protected: tuple[str | Path, ...] = (),
    external_data: bool | None = None,
) -> Path:
    """Write a model atomically; never over a protected (input) file or its weights.

    Models too big for one protobuf (or `external_data=True`) get their weights in
    `<name>.data` next to the model. The data file is renamed into place first, then the
    model, so a reader never sees a model pointing at missing weights; an older `.data`
    the new model does not use is removed.
    """
    plan = OutputPlan()
    for p in protected:
        plan.reads_model(p)
    plan.writes_model(path, "the model")
    with plan.open() as files:
        files.model(proto, path, external_data=external_data)
    return Path(path)


def write_text_atomic(path: str | Path, text: str) -> Path:
    """Write a text artefact atomically (temp file in the same folder, then rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_name(path)
    try:
        write_bytes(tmp, text.encode("utf-8"))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path
