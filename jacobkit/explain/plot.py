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
    plt = _pyplot("explain.plot")

    maps = np.asarray(maps)
    if maps.ndim != 4:
        raise ValueError(
            f"explain.plot(maps=...): expected maps of shape (B, K, H, W), got "
            f"{maps.shape}."
        )
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


def _pyplot(caller: str) -> Any:
    """``matplotlib.pyplot``, or jacobkit's message naming the extra."""
    try:
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise ImportError(
            f"{caller} draws with matplotlib, which is not installed: "
            "pip install 'jacobkit[plots]'"
        ) from err
    return plt


def _displayable(x: np.ndarray) -> np.ndarray:
    """Images scaled to [0, 1]; one channel shown as grey."""
    x = x.astype(np.float64)
    if x.ndim == 4 and x.shape[-1] == 1:
        x = x[..., 0]
    low, high = x.min(), x.max()
    return (x - low) / (high - low) if high > low else np.zeros_like(x)


def plot_influence(
    result: Any,
    test_x: Any,
    train_x: Any,
    *,
    tests: Sequence[int] = (0,),
    k: int = 4,
    image_shape: tuple[int, ...] | None = None,
    test_labels: Any = None,
    train_labels: Any = None,
    size: float = 1.4,
) -> Any:
    """Each test example beside its ``k`` strongest proponents and opponents
    among the training examples, from an
    :class:`~jacobkit.explain.influence.InfluenceResult` (its full scores, or
    its ``top``): one row per test example, the test image first, then the
    proponents (highest score first), then the opponents (lowest first),
    each titled with its index, label and score.

    Args:
        result: what :func:`~jacobkit.explain.tracin` (or ``grad_cos``,
            ``trak``) returned.
        test_x: the test set's images ``(N, H, W[, C])``, or flat features
            with ``image_shape``.
        train_x: the training set's, as ``test_x``.
        tests: the test examples to draw.
        k: proponents and opponents per test example (at most ``top_k``).
        image_shape: ``(H, W)`` or ``(H, W, C)`` of flat inputs (digits:
            ``(8, 8)``).
        test_labels: the test set's labels, shown in the titles where given.
        train_labels: the training set's, as ``test_labels``.
        size: inches per cell.

    Returns:
        The ``matplotlib.figure.Figure``.
    """
    plt = _pyplot("explain.plot_influence")
    _check_influence(result, tests)
    best, best_scores, worst, worst_scores = _strongest(result, k)
    test_images = _images(test_x, image_shape)
    train_images = _images(train_x, image_shape)
    rows = list(tests)
    fig, axes = plt.subplots(
        len(rows),
        1 + 2 * k,
        figsize=(size * (1 + 2 * k), size * len(rows) * 1.15),
        squeeze=False,
    )
    for r, t in enumerate(rows):
        _cell(axes[r, 0], test_images[t], f"test {t}", test_labels, t, None)
        for j in range(k):
            i = int(best[t, j])
            _cell(
                axes[r, 1 + j],
                train_images[i],
                f"+{i}",
                train_labels,
                i,
                best_scores[t, j],
            )
            i = int(worst[t, j])
            _cell(
                axes[r, 1 + k + j],
                train_images[i],
                f"−{i}",
                train_labels,
                i,
                worst_scores[t, j],
            )
    fig.suptitle("test | proponents | opponents", fontsize=9)
    fig.tight_layout()
    return fig


def _check_influence(result: Any, tests: Sequence[int]) -> None:
    """Refuse what is not an influence result's scores, and test rows they
    do not hold."""
    top = getattr(result, "top", None)
    held = top.proponents if top is not None else getattr(result, "scores", result)
    try:
        shape = np.shape(np.asarray(held, dtype=float))
    except (TypeError, ValueError):
        shape = ()
    if len(shape) != 2:
        raise TypeError(
            "explain.plot_influence(result=...): expected an InfluenceResult or "
            f"scores of shape (N_test, N_train), got {type(result).__name__}."
        )
    outside = [t for t in tests if not -shape[0] <= int(t) < shape[0]]
    if outside:
        raise ValueError(
            f"explain.plot_influence(tests={list(tests)}): test rows {outside} "
            f"are not among the result's {shape[0]}."
        )


def _strongest(result: Any, k: int) -> tuple[np.ndarray, ...]:
    top = getattr(result, "top", None)
    if top is not None:
        if top.proponents.shape[1] < k:
            raise ValueError(
                f"plot_influence(k={k}): the result kept top_k="
                f"{top.proponents.shape[1]}; pass k <= that."
            )
        return (
            top.proponents[:, :k],
            top.proponent_scores[:, :k],
            top.opponents[:, :k],
            top.opponent_scores[:, :k],
        )
    scores = np.asarray(result)
    high = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    low = np.argsort(scores, axis=1, kind="stable")[:, :k]
    return (
        high,
        np.take_along_axis(scores, high, 1),
        low,
        np.take_along_axis(scores, low, 1),
    )


def _images(x: Any, shape: tuple[int, ...] | None) -> np.ndarray:
    x = np.asarray(x)
    if shape is not None:
        x = x.reshape((len(x), *shape))
    if x.ndim not in (3, 4):
        raise ValueError(
            f"explain.plot_influence: images must be (N, H, W[, C]), got "
            f"{x.shape}; pass image_shape= for flat inputs."
        )
    return _displayable(x)


def _cell(
    ax: Any, image: np.ndarray, title: str, labels: Any, i: int, score: float | None
) -> None:
    ax.imshow(image, cmap="gray" if image.ndim == 2 else None)
    if labels is not None:
        title += f" ({np.asarray(labels)[i]})"
    if score is not None:
        title += f"\n{score:.3g}"
    ax.set_title(title, fontsize=7)
    ax.set_xticks([])
    ax.set_yticks([])


def plot_tokens(
    attribution: Any,
    *,
    example: int = 0,
    tokens: Sequence[str] | None = None,
    rows: Sequence[str] | None = None,
    cmap: str = "viridis",
    size: float = 0.35,
) -> Any:
    """A token x token heat map of one example of a
    :class:`~jacobkit.explain.tokens.TokenAttribution`: a row per target
    position (or class), a column per input token.

    Args:
        example: which example of the batch.
        tokens: the input tokens' strings (a tokenizer's
            ``id_to_token``), shown under the columns.
        rows: the rows' labels (default: their indices; a causal LM's row
            ``t`` predicts the token after input ``t``).
        cmap: the colormap (``gradient_x_input`` maps diverge: try ``"RdBu_r"``).
        size: inches per cell.

    Returns:
        The ``matplotlib.figure.Figure``.
    """
    plt = _pyplot("explain.plot_tokens")
    held = getattr(attribution, "scores", None)
    if held is None or np.ndim(held) != 3:
        raise TypeError(
            "explain.plot_tokens(attribution=...): expected what "
            "explain.token_attribution returns (scores (B, rows, T)), got "
            f"{type(attribution).__name__}."
        )
    if not -len(held) <= example < len(held):
        raise ValueError(
            f"explain.plot_tokens(example={example}): the attribution holds "
            f"{len(held)} example(s)."
        )
    scores = np.asarray(held)[example]
    count, width = scores.shape
    if tokens is not None and len(tokens) != width:
        raise ValueError(
            f"explain.plot_tokens(tokens=...): {len(tokens)} strings for "
            f"{width} input tokens."
        )
    fig, ax = plt.subplots(
        figsize=(max(3.0, size * width + 1.5), max(2.0, size * count + 1.0))
    )
    image = ax.imshow(scores, cmap=cmap, aspect="auto")
    fig.colorbar(image, ax=ax, label=attribution.method)
    columns = (
        [str(t) for t in tokens]
        if tokens is not None
        else [str(i) for i in range(width)]
    )
    ax.set_xticks(range(width))
    ax.set_xticklabels(columns, rotation=90, fontsize=7)
    labels = (
        [str(r) for r in rows] if rows is not None else [str(i) for i in range(count)]
    )
    ax.set_yticks(range(count))
    ax.set_yticklabels(labels, fontsize=7)
    ax.set_xlabel("input token")
    ax.set_ylabel("target" if attribution.kind == "causal_lm" else "class")
    fig.tight_layout()
    return fig
