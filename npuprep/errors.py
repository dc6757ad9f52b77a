"""User mistakes (one line, exit 2) apart from bugs (traceback)."""

from __future__ import annotations


class NpuprepError(Exception):
    """A mistake in the user's input: the CLI prints the message on one line and exits 2.

    The message names the file, key path, node or tensor at fault. Anything else that
    escapes is a bug and keeps its traceback.
    """

    exit_code = 2

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(message.split()))
