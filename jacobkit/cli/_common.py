"""What the subcommands share: the one-line usage error, the parser, and the
checks of ``--model``/``--inputs``/``--layer``.

Imports no TensorFlow: building the parser must stay fast.
"""

from __future__ import annotations

import argparse
import os
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
    named = ("inputs", "layer", "custom_objects")
    given = [flag for flag in named if getattr(args, flag, None)]
    if given:
        flags = " and ".join(f"--{flag.replace('_', '-')}" for flag in given)
        raise UsageError(
            f"{flags} need{'s' if len(given) == 1 else ''} --model (a saved "
            "Keras model); without --model the built-in generator runs."
        )


def add_custom_objects(parser: argparse.ArgumentParser) -> None:
    """``--custom-objects``: what a saved model with custom layers needs."""
    parser.add_argument(
        "--custom-objects",
        metavar="MODULE:NAME,...",
        help="custom layers (or functions) the saved model holds, by the module "
        "that defines them: my_layers:Scale,my_layers:Gate; a bare module is "
        "imported for what it registers (keras.saving."
        "register_keras_serializable). Modules are found from the current "
        "directory too.",
    )


def custom_objects(spec: str | None) -> dict[str, Any] | None:
    """``--custom-objects`` resolved (a :class:`UsageError` if it cannot be),
    the current directory searched first."""
    if not spec:
        return None
    from jacobkit.keras import saved

    try:
        return saved.custom_objects(spec, search=os.getcwd())
    except ValueError as err:
        raise UsageError(str(err)) from err


def load_model(path: str, custom: str | None = None) -> Any:
    """The saved Keras model at ``path``, with the ``--custom-objects`` given
    as ``custom`` (a :class:`UsageError` if it cannot be loaded)."""
    from jacobkit.keras import saved

    objects = custom_objects(custom)
    try:
        return saved.load(path, custom_objects=objects)
    except ValueError as err:
        raise UsageError(str(err)) from err
