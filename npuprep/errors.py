"""User mistakes (one line, exit 2) apart from failures of npuprep itself (one line, exit 1)."""

from __future__ import annotations


class NpuprepError(Exception):
    """A mistake in the user's input: the CLI prints the message on one line and exits 2.

    The message names the file, key path, node or tensor at fault. Anything else that
    escapes is a bug: the CLI says so on one line (exit 1) and writes the traceback to a file.
    """

    exit_code = 2

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(message.split()))


class InternalError(Exception):
    """A failure of npuprep itself that is not a traceback of its own making, e.g. onnxruntime
    refusing a model npuprep wrote from a model it loaded: reported as a bug, never blamed on
    the input."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(message.split()))
