"""DP-SGD inside Keras: ``make_private(model, ...)`` then ``compile`` and
``fit`` on a :class:`PoissonSampler`; epsilon from ``dp-accounting``
(the extra ``jacobkit[privacy]``), per epoch with :class:`EpsilonCallback`.

>>> import jacobkit as jk
>>> sampler = jk.privacy.PoissonSampler((x, y), sampling_rate=0.05)  # doctest: +SKIP
>>> private = jk.privacy.make_private(model, l2_norm_clip=1.0,     # doctest: +SKIP
...     noise_multiplier=1.1, sampling_rate=0.05, num_examples=len(x))
>>> private.compile("sgd", keras.losses.SparseCategoricalCrossentropy(
...     from_logits=True, reduction=None))                          # doctest: +SKIP
>>> private.fit(sampler, epochs=5,
...     callbacks=[jk.privacy.EpsilonCallback(delta=1e-5)])         # doctest: +SKIP

See ``docs/privacy.md``.
"""

from __future__ import annotations

from jacobkit.privacy.accounting import EpsilonCallback, epsilon
from jacobkit.privacy.model import Privacy, PrivateModel, make_private
from jacobkit.privacy.sampling import PoissonSampler
from jacobkit.privacy.step import Clipping, noise

__all__ = [
    "Clipping",
    "EpsilonCallback",
    "PoissonSampler",
    "Privacy",
    "PrivateModel",
    "epsilon",
    "make_private",
    "noise",
]
