"""An exception npuprep did not expect -> `npuprep: error: this is a bug, please report ...`
on one line, exit 1; the traceback goes to a file named there, not to the terminal."""

from __future__ import annotations

import errno
import os
import sys
import tempfile
import traceback

from npuprep import __version__
from npuprep.names import shown

# OSErrors that come from the machine (space, quota, a failing disk or mount), not from npuprep.
ENVIRONMENT_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS, errno.ENOMEM,
                                errno.ESTALE, errno.EFBIG})


def report_bug(exc: BaseException, argv: list[str]) -> int:
    """One line naming the failure and the file with its details; exit code 1."""
    details = (f"npuprep {__version__}, python {sys.version.split()[0]}\n"
               f"command: npuprep {' '.join(argv)}\n\n"
               + "".join(traceback.format_exception(exc)))
    try:
        fd, path = tempfile.mkstemp(prefix="npuprep-bug-", suffix=".txt")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(details)
        where = f"; details in {path}"
    except OSError:
        where = ""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    message = f"{type(exc).__name__}: {first}" if first else type(exc).__name__
    print(f"npuprep: error: this is a bug, please report it: {shown(message)[:300]}{where}",
          file=sys.stderr)
    return 1
