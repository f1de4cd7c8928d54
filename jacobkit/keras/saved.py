"""Load a saved Keras model with the Keras that saved it.

A ``.keras`` file written by ``tf_keras`` (Keras 2) does not load in Keras 3
(``Unrecognized keyword arguments passed to Dense: {'batch_input_shape':
...}``), and a Keras 3 file does not load in ``tf_keras``. Both formats record
the version that wrote them: ``metadata.json`` inside a ``.keras`` zip, the
``keras_version`` attribute of an ``.h5`` file.
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path
from typing import Any

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


def load(path: str | Path, *, flag: str = "--model") -> Any:
    """The model saved at ``path``, loaded (uncompiled) with Keras 3 or
    ``tf_keras``, whichever wrote it.

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
        return keras_module.models.load_model(str(path), compile=False)
    except (ValueError, TypeError, OSError, KeyError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise ValueError(
            f"{flag} {path}: could not be loaded by "
            f"{keras_module.__name__} {keras_module.__version__}: {first}"
        ) from err
