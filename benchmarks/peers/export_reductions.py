"""Write the reductions benchmark's ``convnet`` (weights, one batch) and
jacobkit's own results on that batch to an ``.npz``, so the PyTorch anchor
(``reductions_torch.py``) differentiates the very same function and checks
that it computes the same numbers.

The model is ``benchmarks/reductions_models.py``'s ``convnet``: 32×32×3 NHWC
images → Conv2D 3→32 (3×3, relu, ``conv1``) → Conv2D 32→64 (3×3, stride 2,
relu, ``conv2``) → global average pooling → Dense 64→10 (``head``), B=32,
each example's sparse cross-entropy from logits.

The file holds, in Keras layouts (kernels ``(kh, kw, in, out)`` and
``(in, out)``): ``x`` (NHWC), ``y``, ``<layer>_kernel`` and ``<layer>_bias``;
and jacobkit's references: ``clip`` (C), ``clipped_<layer>_kernel`` and
``clipped_<layer>_bias`` (``jk.ClippedSum(C)``'s sum of clipped per-example
gradients), ``norms`` (each example's gradient norm before clipping) and
``gram`` (``jk.gram``'s ``(B, B)`` matrix, float64), ``projection``
(``reduce=jk.Project(dim)``'s ``(B, dim)`` rows) with ``dim`` and the maps
it applied, so that the peer projects by the very same maps:
``map_<layer>_<part>_buckets`` and ``_signs`` (a small target's
CountSketch, applied by the peer as jacobkit applies it: one add per
coordinate), ``_dense`` ``(size, dim)`` (a Gaussian map), or the Kronecker
factors ``_left`` and ``_right`` (``jacobkit.problem.sketch``).

``--case bert`` (and ``bert_small``) writes BERT under Hugging Face's names
and layouts (``bert_layout.py``); ``--case gpt2`` the causal LM under
``GPT2LMHeadModel``'s (``export_gpt2.py``'s weights; each Keras variable's
place in its Hugging Face parameter from ``gpt2_layout.py``, so that the
peer takes the query, key and value out of ``c_attn`` to map them): see
:func:`bert` and :func:`gpt2`.

    python benchmarks/peers/export_reductions.py --out /tmp/reductions.npz
    python benchmarks/peers/export_reductions.py --case gpt2 --out /tmp/gpt2.npz
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import reductions_models  # noqa: E402

import jacobkit as jk  # noqa: E402
from jacobkit.problem import sketch  # noqa: E402

LAYERS = ("conv1", "conv2", "head")


def bert(args: argparse.Namespace) -> dict[str, np.ndarray]:
    """The ``bert`` case (BERT tiny; ``bert_small`` alike) under Hugging
    Face's names and layouts (``bert_layout.py``): ``hf__<name>`` weights,
    ``clipped__<name>`` references, the backbone's sizes, the inputs, the
    Keras logits, the norms and the Gram matrix."""
    import bert_layout

    case = reductions_models.CASES[args.case]()
    model = case.model
    backbone = model.backbone
    loss = jk.Loss(reductions_models.loss())
    arrays: dict[str, np.ndarray] = {
        "case": np.asarray("bert"),  # the kind of model (BERT tiny or small)
        "name": np.asarray(args.case),
        **{k: np.asarray(v) for k, v in case.x.items()},
        "y": case.y,
        "vocabulary_size": np.asarray(backbone.vocabulary_size),
        "num_layers": np.asarray(backbone.num_layers),
        "num_heads": np.asarray(backbone.num_heads),
        "hidden_dim": np.asarray(backbone.hidden_dim),
        "intermediate_dim": np.asarray(backbone.intermediate_dim),
        "max_sequence_length": np.asarray(backbone.max_sequence_length),
        "num_classes": np.asarray(model.num_classes),
        "logits": np.asarray(model(case.x)),
    }
    for variable in model.trainable_variables:
        name, array = bert_layout.hf(variable.path, np.asarray(variable))
        arrays[f"hf__{name}"] = array
    clipped = jk.jacobian(
        model,
        (case.x, case.y),
        model.trainable_variables,
        outputs=loss,
        reduce=jk.ClippedSum(args.clip),
    )
    for key, variable in zip(clipped.jacobians, model.trainable_variables):
        name, array = bert_layout.hf(variable.path, np.asarray(clipped[key]))
        arrays[f"clipped__{name}"] = array
    # the projection's maps, each under the Hugging Face name of its
    # variable, with the variable's Keras shape and layout change, so that
    # the peer turns its gradients into Keras layouts and maps them alike
    for _, variable, parts in _norms_gram_projection(arrays, case, loss, clipped, args):
        name, layout = bert_layout.name_and_layout(variable.path)
        arrays[f"kshape__{name}"] = np.asarray(variable.shape)
        arrays[f"layout__{name}"] = np.asarray(layout)
        arrays.update({f"map__{name}_{part}": m for part, m in parts.items()})
    return arrays


def gpt2(args: argparse.Namespace) -> dict[str, np.ndarray]:
    """The ``gpt2`` case (keras_hub's ``GPT2CausalLM``) under Hugging Face's
    names and layouts (``GPT2LMHeadModel``; ``export_gpt2.py``'s weights,
    ``gpt2_layout.py``'s views): the model's sizes (``export_gpt2.py``'s
    keys), ``token_ids`` and ``y`` ``(B, T)``, the Keras ``logits``
    ``(B, T, V)``, ``transformer.*`` weights, ``clipped__<name>``
    references, the norms, the Gram matrix, the projection and, per Keras
    variable ``i`` (in ``trainable_variables``' order), ``view__<i>_name``
    (its Hugging Face parameter), ``view__<i>_index`` (its elements' places
    in that parameter, in the variable's shape) and ``map__<i>_<part>``."""
    import export_gpt2
    import gpt2_layout

    case = reductions_models.gpt2()
    model = case.model
    backbone = model.backbone
    loss = jk.Loss(reductions_models.loss("gpt2"))
    weights = export_gpt2.hf_weights(backbone)
    shapes = {name: array.shape for name, array in weights.items()}
    views = gpt2_layout.views(backbone, shapes)
    variables = model.trainable_variables
    outside = [v.path for v in variables if v.path not in views]
    if outside:
        raise SystemExit(f"export_reductions: no Hugging Face name for {outside}")
    mine = gpt2_layout.to_hf(views, shapes, {v.path: np.asarray(v) for v in variables})
    for name, array in weights.items():  # keras_hub's converter agrees
        np.testing.assert_array_equal(mine[name], array, err_msg=name)
    arrays: dict[str, np.ndarray] = {
        "case": np.asarray("gpt2"),
        **weights,
        **{k: np.asarray(v) for k, v in reductions_models.GPT2.items()},
        "layer_norm_epsilon": np.asarray(export_gpt2.EPSILON),
        "token_ids": case.x["token_ids"],
        "y": case.y,
        "logits": np.asarray(model(case.x), "float32"),
    }
    if not np.all(case.x["padding_mask"] == 1):
        raise SystemExit("export_reductions: GPT-2 runs without a mask: pad nothing")
    clipped = jk.jacobian(
        model,
        (case.x, case.y),
        variables,
        outputs=loss,
        reduce=jk.ClippedSum(args.clip),
    )
    by_path = {
        v.path: np.asarray(clipped[key]) for key, v in zip(clipped.jacobians, variables)
    }
    for name, array in gpt2_layout.to_hf(views, shapes, by_path).items():
        arrays[f"clipped__{name}"] = array
    found = _norms_gram_projection(arrays, case, loss, clipped, args)
    for index, (_, variable, parts) in enumerate(found):
        name, elements = views[variable.path]
        arrays[f"view__{index}_name"] = np.asarray(name)
        arrays[f"view__{index}_index"] = elements
        arrays.update({f"map__{index}_{part}": m for part, m in parts.items()})
    return arrays


def _norms_gram_projection(
    arrays: dict[str, np.ndarray], case: Any, loss: jk.Loss, clipped: Any, args: Any
) -> list[tuple[str, Any, dict[str, np.ndarray]]]:
    """What both cases export beside the clipped sums, into ``arrays``: the
    norms, the clip, the Gram matrix and the projection by ``jk.Project``;
    returns each target's key, variable and its map's parts (``dense``, or
    the Kronecker ``left`` and ``right``), for the case to name."""
    model = case.model
    arrays["norms"] = np.asarray(clipped.norms)
    arrays["clip"] = np.asarray(args.clip, "float32")
    gram = jk.gram(model, (case.x, case.y), None, outputs=loss, progress=False)
    arrays["gram"] = np.asarray(gram.matrix)
    project = jk.Project(args.dim)
    projected = jk.jacobian(
        model,
        (case.x, case.y),
        model.trainable_variables,
        outputs=loss,
        reduce=project,
    )
    arrays["projection"] = np.asarray(projected.projection)
    arrays["dim"] = np.asarray(args.dim)
    found = []
    for key, variable in zip(projected.jacobians, model.trainable_variables):
        target = sketch.target_map(project, key, tuple(variable.shape))
        # each map as jacobkit holds it, so the peer applies it the same
        # way: a CountSketch's buckets and signs (one add per coordinate,
        # not a dense matmul), a Gaussian map dense, a Kronecker map's factors
        if target.kronecker:
            parts = {"left": target.left, "right": target.right}
        elif target.sparse:
            parts = {"buckets": target.buckets, "signs": target.signs}
        else:
            parts = {"dense": target.matrix()}
        found.append((key, variable, parts))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="reductions.npz")
    parser.add_argument("--clip", type=float, default=1.0, help="C of ClippedSum")
    parser.add_argument("--dim", type=int, default=2048, help="of jk.Project")
    parser.add_argument(
        "--case", choices=("convnet", "bert", "bert_small", "gpt2"), default="convnet"
    )
    args = parser.parse_args()
    if args.case != "convnet":
        make = gpt2 if args.case == "gpt2" else bert
        np.savez(args.out, **make(args))
        print(f"wrote {args.out}")
        return
    case = reductions_models.convnet()
    model = case.model
    arrays: dict[str, np.ndarray] = {"x": np.asarray(case.x), "y": case.y}
    for name in LAYERS:
        layer = model.get_layer(name)
        arrays[f"{name}_kernel"] = np.asarray(layer.kernel)
        arrays[f"{name}_bias"] = np.asarray(layer.bias)
    loss = jk.Loss(reductions_models.loss())
    clipped = jk.jacobian(
        model,
        (case.x, case.y),
        model.trainable_variables,
        outputs=loss,
        reduce=jk.ClippedSum(args.clip),
    )
    for key in clipped.jacobians:
        # "conv1/kernel" -> "clipped_conv1_kernel"
        arrays["clipped_" + key.replace("/", "_")] = np.asarray(clipped[key])
    missing = [
        f"clipped_{name}_{part}"
        for name in LAYERS
        for part in ("kernel", "bias")
        if f"clipped_{name}_{part}" not in arrays
    ]
    if missing:
        raise SystemExit(
            f"export_reductions: jacobkit's result has keys {list(clipped.jacobians)}"
            f", not {missing}"
        )
    for key, _, parts in _norms_gram_projection(arrays, case, loss, clipped, args):
        flat = key.replace("/", "_")
        arrays.update({f"map_{flat}_{part}": m for part, m in parts.items()})
    np.savez(args.out, **arrays)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
