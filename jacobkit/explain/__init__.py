"""Attributions for every class in one call, on top of :func:`jacobkit.jacobian`.

>>> from jacobkit import explain
>>> maps = explain.saliency(model, x)                  # doctest: +SKIP
>>> maps.shape                                         # (B, K, H, W)  # doctest: +SKIP

Each method returns a map per example and **per class** — the model output's
last axis, or the subset ``classes=[...]`` — shaped ``(B, K, ...)``, from one
:func:`jacobkit.jacobian` call (per chunk of interpolation steps or noisy
samples): the rows are the per-example classes, the target is the input
(:class:`jacobkit.Inputs`) or a layer's activation (:class:`jacobkit.Output`).
So ``jacobian`` picks the strategy, honours ``memory_budget`` and traces once
per input signature. Grad-CAM through a pooled linear head
(``GlobalAveragePooling2D -> Dense``) needs no gradient pass at all: every
class's map is one matmul of the activations by the head's kernel.
Integrated gradients come in a record with each row's
completeness gap (:class:`IntegratedGradients`; a
:class:`CompletenessWarning` where it is large). xplique and tf-keras-vis
compute one class per call; their equivalent settings are given in each
method's docstring.

Which *training examples* explain a prediction: :func:`tracin`,
:func:`grad_cos`, :func:`self_influence` (exact, from :func:`jacobkit.gram`
and ghost norms) and :func:`trak` (projected, ``reduce=jk.Project``), each
over a model or its checkpoints, on arrays or datasets.

Works on Keras 3 and ``tf_keras`` models, nested backbones (a layer inside a
sub-model), and on plain callables ``f(x) -> (B, ..., K)`` for the input
methods (Grad-CAM needs a layer of a functional or Sequential model).
"""

from __future__ import annotations

from jacobkit.explain.cam import grad_cam
from jacobkit.explain.completeness import CompletenessWarning
from jacobkit.explain.generation import generate_and_attribute
from jacobkit.explain.influence import (
    InfluenceResult,
    grad_cos,
    self_influence,
    tracin,
)
from jacobkit.explain.input_maps import (
    IntegratedGradients,
    gradient_x_input,
    integrated_gradients,
    saliency,
    smoothgrad,
)
from jacobkit.explain.plot import plot, plot_influence, plot_tokens
from jacobkit.explain.tokens import TokenAttribution, token_attribution
from jacobkit.explain.top import TopK
from jacobkit.explain.trak import trak

__all__ = [
    "CompletenessWarning",
    "InfluenceResult",
    "IntegratedGradients",
    "TokenAttribution",
    "TopK",
    "grad_cam",
    "generate_and_attribute",
    "grad_cos",
    "gradient_x_input",
    "integrated_gradients",
    "plot",
    "plot_influence",
    "plot_tokens",
    "saliency",
    "self_influence",
    "smoothgrad",
    "token_attribution",
    "tracin",
    "trak",
]
