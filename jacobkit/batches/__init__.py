"""Beyond one batch: Jacobians over a dataset, in memory or into ``out=``.

Public as ``jacobkit.data``: :class:`batches` (``jk.data.batches(x, 64)``, an
array's batches without copying). The modules, in the order data flows:

- :mod:`~jacobkit.batches.source`: the batches of a dataset, an iterable or
  one batch of arrays, and their checks;
- :mod:`~jacobkit.batches.collect`: ``jacobian()`` over them (the loop), with
  :mod:`~jacobkit.batches.runners` computing each batch on one device or on
  the replicas of ``distribute=`` (:mod:`~jacobkit.batches.distribute`);
- :mod:`~jacobkit.batches.store`: the ``out=`` directory (its manifest in
  :mod:`~jacobkit.batches.manifest`, the call's identity in
  :mod:`~jacobkit.batches.fingerprint`).
"""

from __future__ import annotations

from jacobkit.batches.source import batches
from jacobkit.problem.arguments import is_batches, warn_non_finite

__all__ = ["batches", "is_batches", "warn_non_finite"]
