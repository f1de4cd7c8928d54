"""Device names: TensorFlow's short form, ``"CPU:0"`` or ``"GPU:0"``."""

from __future__ import annotations

import re

import tensorflow as tf

__all__ = ["device_index", "normalize_device"]

_DEVICE_RE = re.compile(
    r"^(?:/job:[^/]+/replica:\d+/task:\d+)?/?(?:device:)?(cpu|gpu)(?::(\d+))?$",
    re.IGNORECASE,
)
_ACCEPTED_DEVICES = (
    "'CPU:0', 'GPU:0', '/GPU:0', '/device:GPU:0', "
    "'/job:localhost/replica:0/task:0/device:GPU:0' (any index), or None"
)


def normalize_device(device: str | None) -> str:
    """Return the short TensorFlow name (``"CPU:0"``, ``"GPU:1"``) of a device.

    Args:
        device: ``"CPU:0"``, ``"gpu:1"``, ``"/GPU:0"``, ``"/device:GPU:0"``, a
            full name such as ``"/job:localhost/replica:0/task:0/device:CPU:0"``
            (a tensor's ``.device``), or a bare ``"CPU"``/``"GPU"`` (index 0).
            ``None`` picks ``"GPU:0"`` if TensorFlow sees a GPU, else
            ``"CPU:0"``.

    Raises:
        ValueError: the string is not a CPU or GPU device name.
        TypeError: ``device`` is neither a string nor ``None``.

    Example:
        >>> normalize_device("/device:gpu:1")
        'GPU:1'
    """
    if device is None:
        return "GPU:0" if tf.config.list_physical_devices("GPU") else "CPU:0"
    if not isinstance(device, str):
        raise TypeError(
            f"device must be a string such as 'CPU:0' or 'GPU:0', or None; "
            f"got {type(device).__name__}: {device!r}"
        )
    match = _DEVICE_RE.match(device.strip())
    if match is None:
        raise ValueError(
            f"device {device!r} is not a known device; accepted forms: "
            f"{_ACCEPTED_DEVICES}"
        )
    kind, index = match.groups()
    return f"{kind.upper()}:{int(index or 0)}"


def device_index(device: str) -> int:
    """The index of a normalized device name: ``"GPU:1"`` -> 1."""
    return int(device.split(":")[1])
