"""A grid of maps: one row per image, one column per class."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np


def plot(
    maps: Any,
    x: Any = None,
    *,
    classes: Sequence[Any] | None = None,
    alpha: float = 0.5,
    cmap: str = "jet",
    size: float = 1.6,
) -> Any:
    """Draw ``maps`` (``(B, K, H, W)``) as a matplotlib grid: one row per
    image, one column per class, each map over its image where ``x`` (``(B,
    H, W, C)`` or ``(B, H, W)``) is given.

    Args:
        classes: column titles, one per class (default ``0 .. K-1``).
        alpha: the maps' opacity over the images.
        cmap: the maps' colormap.
        size: inches per cell.

    Returns:
        The ``matplotlib.figure.Figure``.
    """
    try:
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise ImportError(
            "explain.plot draws with matplotlib, which is not installed: "
            "pip install 'jacobkit[plots]'"
        ) from err

    maps = np.asarray(maps)
    if maps.ndim != 4:
        raise ValueError(f"explain.plot: maps must be (B, K, H, W), got {maps.shape}")
    batch, count = maps.shape[:2]
    titles = list(classes) if classes is not None else list(range(count))
    if len(titles) != count:
        raise ValueError(
            f"explain.plot(classes=...): {len(titles)} names for {count} classes "
            f"(maps of shape {maps.shape}, (B, K, H, W)). Pass one name per "
            f"class, or plot the named classes' maps only: maps[:, :{len(titles)}]."
        )
    fig, axes = plt.subplots(
        batch, count, figsize=(size * count, size * batch), squeeze=False
    )
    images = None if x is None else _displayable(np.asarray(x))
    for b in range(batch):
        for k in range(count):
            ax = axes[b, k]
            if images is not None:
                ax.imshow(images[b], cmap="gray" if images[b].ndim == 2 else None)
            ax.imshow(maps[b, k], cmap=cmap, alpha=alpha if images is not None else 1)
            ax.set_xticks([])
            ax.set_yticks([])
            if b == 0:
                ax.set_title(str(titles[k]), fontsize=9)
    fig.tight_layout()
    return fig


def _displayable(x: np.ndarray) -> np.ndarray:
    """Images scaled to [0, 1]; one channel shown as grey."""
    x = x.astype(np.float64)
    if x.ndim == 4 and x.shape[-1] == 1:
        x = x[..., 0]
    low, high = x.min(), x.max()
    return (x - low) / (high - low) if high > low else np.zeros_like(x)
