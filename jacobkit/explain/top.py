"""The training set's parts and the scores merged over checkpoints, for
:mod:`jacobkit.explain.influence`: the full matrix, or with ``top_k=`` each
test example's strongest proponents and opponents, streamed over parts of
the training set (:class:`TopK`)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import tensorflow as tf

from jacobkit.batches import passes


@dataclass(frozen=True)
class TopK:
    """Each test example's strongest training examples of each sign.

    Attributes:
        proponents: ``(N_test, k)`` training indices, highest score first.
        proponent_scores: their scores.
        opponents: ``(N_test, k)`` training indices, lowest score first.
        opponent_scores: their scores.
    """

    proponents: np.ndarray
    proponent_scores: np.ndarray
    opponents: np.ndarray
    opponent_scores: np.ndarray


def check_top_k(top_k: Any, call: str = "tracin") -> int | None:
    if top_k is None:
        return None
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
        raise ValueError(
            f"explain.{call}(top_k={top_k!r}): expected a positive int, or None."
        )
    return top_k


#: training examples per Gram call with ``top_k=`` (the matrix held is
#: ``N_test x TOP_K_CHUNK`` per checkpoint)
TOP_K_CHUNK = 4096


def streamed(train: Any, top_k: int | None) -> Any:
    """The training set as :func:`parts` reads it on every checkpoint: with
    ``top_k=``, a checked dataset re-batched into parts of
    :data:`TOP_K_CHUNK` examples (each pass checked against the first:
    :class:`~jacobkit.batches.passes.Checked`); else as it is."""
    if top_k is not None and isinstance(train, passes.Checked):
        return train.rebatched(TOP_K_CHUNK)
    return train


def parts(train: Any, top_k: int | None) -> Iterator[Any]:
    """The training set whole, or with ``top_k=`` in parts of
    :data:`TOP_K_CHUNK` examples (a dataset: its batches, re-batched by
    :func:`streamed`)."""
    if top_k is None:
        yield train
        return
    if isinstance(train, passes.Checked):
        yield from train
        return
    if isinstance(train, tf.data.Dataset):
        yield from train.unbatch().batch(TOP_K_CHUNK)
        return
    arrays = tuple(train)
    count = len(tf.nest.flatten(arrays[0])[0])
    for begin in range(0, count, TOP_K_CHUNK):
        part = slice(begin, begin + TOP_K_CHUNK)
        yield tf.nest.map_structure(lambda a, part=part: a[part], arrays)


class Merged:
    """The scores summed over checkpoints: the full matrix, or (``top_k``)
    the running top and bottom ``k`` per test example of each part, merged
    once every checkpoint has added its part (a part's score is the sum over
    checkpoints, so parts are kept until then)."""

    def __init__(self, top_k: int | None) -> None:
        self.top_k = top_k
        self._parts: dict[int, np.ndarray] = {}

    def add(self, offset: int, scores: np.ndarray) -> None:
        """Adds a part's scores (taken over: the caller's array is summed
        into in place, with no copy of a full matrix per checkpoint)."""
        kept = self._parts.get(offset)
        if kept is None:
            self._parts[offset] = scores
        else:
            kept += scores

    def scores(self) -> np.ndarray | None:
        if self.top_k is not None:
            return None
        if len(self._parts) == 1:
            (only,) = self._parts.values()
            return only
        return np.concatenate([self._parts[o] for o in sorted(self._parts)], axis=1)

    def top(self) -> TopK | None:
        if self.top_k is None:
            return None
        k = self.top_k
        best: tuple[np.ndarray, np.ndarray] | None = None
        worst: tuple[np.ndarray, np.ndarray] | None = None
        for offset in sorted(self._parts):
            part = self._parts[offset]
            index = np.broadcast_to(np.arange(part.shape[1]) + offset, part.shape)
            best = _keep(best, part, index, k, largest=True)
            worst = _keep(worst, part, index, k, largest=False)
        assert best is not None and worst is not None, "at least one part"
        return TopK(best[1], best[0], worst[1], worst[0])


def _keep(
    kept: tuple[np.ndarray, np.ndarray] | None,
    scores: np.ndarray,
    index: np.ndarray,
    k: int,
    *,
    largest: bool,
) -> tuple[np.ndarray, np.ndarray]:
    """The ``k`` largest (or smallest) of ``kept`` and ``scores`` per row,
    ordered, with their training indices."""
    if kept is not None:
        scores = np.concatenate([kept[0], scores], axis=1)
        index = np.concatenate([kept[1], index], axis=1)
    key = -scores if largest else scores
    order = np.argsort(key, axis=1, kind="stable")[:, :k]
    return np.take_along_axis(scores, order, 1), np.take_along_axis(index, order, 1)
