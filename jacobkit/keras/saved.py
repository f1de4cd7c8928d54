"""Load a saved Keras model with the Keras that saved it, and the custom
objects it needs (:func:`custom_objects`).

A ``.keras`` file written by ``tf_keras`` (Keras 2) does not load in Keras 3
(``Unrecognized keyword arguments passed to Dense: {'batch_input_shape':
...}``), and a Keras 3 file does not load in ``tf_keras``. Both formats record
the version that wrote them: ``metadata.json`` inside a ``.keras`` zip, the
``keras_version`` attribute of an ``.h5`` file.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import re
import sys
import zipfile
from pathlib import Path
from typing import Any

from jacobkit.keras import compat

#: file extensions :func:`load` reads
SUFFIXES = (".keras", ".h5", ".hdf5")


def saved_keras_version(path: str | Path) -> str | None:
    """The ``keras_version`` a ``.keras`` or ``.h5`` file records, if any."""
    path = Path(path)
    try:
        if zipfile.is_zipfile(path):
            with zipfile.ZipFile(path) as archive:
                metadata = json.loads(archive.read("metadata.json"))
            return str(metadata.get("keras_version") or "") or None
        import h5py

        with h5py.File(path, "r") as saved:
            version = saved.attrs.get("keras_version")
    except (OSError, KeyError, ValueError, ImportError):
        return None
    if isinstance(version, bytes):
        version = version.decode()
    return str(version) if version else None


def custom_objects(
    spec: str, *, flag: str = "--custom-objects", search: str | None = None
) -> dict[str, Any]:
    """The classes and functions ``spec`` names, by name, for loading a model
    that holds them: ``"module:Name,other.module:Other"``; a bare
    ``"module"`` is imported only (what it registers with
    ``keras.saving.register_keras_serializable`` is then found by name).

    ``search``: a directory tried first for the modules, as ``python -m``
    tries the current one. Raises ``ValueError`` naming ``flag`` for a
    module that does not import or a name it does not hold.
    """
    if search is not None and search not in sys.path:
        sys.path.insert(0, search)
    found: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        module_name, _, name = item.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as err:
            raise ValueError(
                f"{flag} {item}: cannot import {module_name!r} ({err}). Give the "
                "module as Python imports it (run from its directory, or add "
                "that directory to PYTHONPATH), e.g. my_layers:MyLayer."
            ) from err
        if not name:
            continue
        if not hasattr(module, name):
            raise ValueError(
                f"{flag} {item}: module {module_name!r} has no {name!r}. Name "
                "the custom layer's class as the module defines it."
            )
        found[name] = getattr(module, name)
    return found


def object_scope(objects: dict[str, Any] | None) -> contextlib.AbstractContextManager:
    """Keras 3's (and ``tf_keras``'s, where installed) custom-object scope
    for ``objects``, in which a model holding them can be rebuilt from its
    config (its float64 copy); nothing for ``None``."""
    stack = contextlib.ExitStack()
    if objects:
        for module in compat.keras_modules():
            saving = getattr(module, "saving", None)
            scope = getattr(saving, "custom_object_scope", None)
            stack.enter_context((scope or module.utils.custom_object_scope)(objects))
    return stack


def load(
    path: str | Path,
    *,
    flag: str = "--model",
    custom_objects: dict[str, Any] | None = None,
) -> Any:
    """The model saved at ``path``, loaded (uncompiled) with Keras 3 or
    ``tf_keras``, whichever wrote it; ``custom_objects`` as Keras takes them
    (:func:`custom_objects` reads them from a command line's names).

    Raises ``ValueError`` naming ``flag`` for a missing file, an unknown
    format, or a file that neither Keras reads.
    """
    path = Path(path)
    if not path.exists():
        raise ValueError(f"{flag} {path}: no such file.")
    if path.suffix not in SUFFIXES:
        raise ValueError(
            f"{flag} {path}: expected a saved Keras model ({', '.join(SUFFIXES)}), "
            "as written by model.save()."
        )
    version = saved_keras_version(path)
    if version is not None and version.startswith("2."):
        try:
            import tf_keras as keras_module
        except ImportError as err:
            raise ValueError(
                f"{flag} {path}: saved by Keras {version} (tf_keras), which is not "
                "installed here. Install tf_keras to load it."
            ) from err
    else:
        import keras as keras_module
    try:
        return keras_module.models.load_model(
            str(path), compile=False, custom_objects=custom_objects
        )
    except (ValueError, TypeError, OSError, KeyError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        missing = _missing_class(str(err))
        if missing is not None:
            module, name = missing
            raise ValueError(
                f"{flag} {path}: the model holds the custom class {name!r} (from "
                f"module {module!r}), which {keras_module.__name__} cannot "
                f"rebuild unless it is given: --custom-objects {module}:{name} "
                "(run from the module's directory, or add it to PYTHONPATH)."
            ) from err
        raise ValueError(
            f"{flag} {path}: could not be loaded by "
            f"{keras_module.__name__} {keras_module.__version__}: {first}"
        ) from err


def _missing_class(message: str) -> tuple[str, str] | None:
    """``(module, name)`` of the class Keras could not locate, read from its
    message ("Could not locate class 'Scale'. ... Full object config:
    {'module': 'my_layers', 'class_name': 'Scale', ...}"), or ``None``."""
    found = re.search(r"Could not locate class '([^']+)'", message)
    if found is None:
        return None
    name = found.group(1)
    module = re.search(
        rf"'module': '([^']+)', 'class_name': '{re.escape(name)}'", message
    )
    return (module.group(1) if module else "module", name)
