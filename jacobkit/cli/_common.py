"""What the subcommands share: the one-line usage error, the parser, and the
checks of ``--model``/``--inputs``/``--layer``.

Imports no TensorFlow: building the parser must stay fast.
"""

from __future__ import annotations

import argparse
from typing import Any

#: exit code for a user's mistake (argparse's own for a bad option)
USAGE_ERROR = 2


class UsageError(Exception):
    """A mistake in what the user asked for: reported in one line, exit code 2."""


class Parser(argparse.ArgumentParser):
    """argparse, with its errors in one line (no usage block)."""

    def error(self, message: str):
        self.exit(
            USAGE_ERROR,
            f"{self.prog}: error: {message} (see {self.prog} --help)\n",
        )


def check_model_flags(args: argparse.Namespace) -> None:
    """``--model`` needs ``--inputs`` and ``--layer``, and they need it
    (without ``--model`` the built-in generator runs)."""
    if args.model:
        if not (args.inputs and args.layer):
            raise UsageError("--model needs --inputs X.npy and --layer NAME")
        return
    given = [flag for flag in ("inputs", "layer") if getattr(args, flag)]
    if given:
        flags = " and ".join(f"--{flag}" for flag in given)
        raise UsageError(
            f"{flags} need{'s' if len(given) == 1 else ''} --model (a saved "
            "Keras model); without --model the built-in generator runs."
        )


def load_model(path: str) -> Any:
    """The saved Keras model at ``path`` (a :class:`UsageError` if it cannot
    be loaded)."""
    from jacobkit.keras import saved

    try:
        return saved.load(path)
    except ValueError as err:
        raise UsageError(str(err)) from err
