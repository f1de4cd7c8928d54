"""All-class attributions: ``jacobkit.explain`` against one call per class.

For each model (the notebook's small CNN, and a frozen MobileNetV2 backbone
with a new head, random weights), measures in one process, steady (each
traced first), in alternating rounds (median):

- saliency for every class: ``explain.saliency`` against one compiled
  batched gradient per class (how xplique computes it: its docs tile the
  inputs per class) and against tf-keras-vis's ``Saliency`` (one
  ``CategoricalScore`` per class);
- Grad-CAM for every class: ``explain.grad_cam(resize=False)`` against one
  compiled gradient of the activation per class and tf-keras-vis's
  ``Gradcam``;
- integrated gradients (``steps=32``, every class) against one compiled
  batched gradient of the ``steps x B`` interpolated inputs per class.

Each pair is checked to give the same maps before it is timed. xplique
itself pins ``tensorflow<=2.20``: it is compared where importable, and the
report says so otherwise.

    python benchmarks/explain.py --out benchmarks/results/cpu
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from jacobkit import explain  # noqa: E402


def _cnn(classes: int) -> tuple[keras.Model, str, np.ndarray]:
    inp = keras.Input((16, 16, 1))
    h = keras.layers.Conv2D(16, 3, padding="same", activation="relu", name="conv1")(inp)
    h = keras.layers.Conv2D(16, 3, padding="same", activation="relu", name="conv2")(h)
    h = keras.layers.Flatten()(keras.layers.MaxPooling2D(4)(h))
    model = keras.Model(inp, keras.layers.Dense(classes, name="head")(h))
    x = np.random.default_rng(0).normal(size=(16, 16, 16, 1)).astype("float32")
    return model, "conv2", x


def _mobilenet(classes: int) -> tuple[keras.Model, str, np.ndarray]:
    keras.utils.set_random_seed(0)
    base = keras.applications.MobileNetV2(
        input_shape=(96, 96, 3), alpha=0.35, weights=None, include_top=False
    )
    base.trainable = False
    inp = keras.Input((96, 96, 3))
    h = keras.layers.GlobalAveragePooling2D()(base(inp, training=False))
    model = keras.Model(inp, keras.layers.Dense(classes, name="head")(h))
    x = np.random.default_rng(0).normal(size=(8, 96, 96, 3)).astype("float32")
    return model, f"{base.name}/Conv_1", x


def _class_gradient(model):
    """``(x, k) -> d sum_b Y[b, k] / dx``, compiled: one batched gradient per
    class, as xplique computes its attributions."""

    @tf.function
    def grad(x, k):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = model(x)[:, k]
        return tape.gradient(y, x)

    return grad


def _per_class_saliency(model, x, classes):
    """One compiled batched gradient per class (xplique's way)."""
    grad = _class_gradient(model)
    x = tf.constant(x)
    return lambda: tf.stack(
        [tf.reduce_max(tf.abs(grad(x, tf.constant(k))), -1) for k in range(classes)], 1
    )


def _per_class_ig(model, x, classes, steps):
    grad = _class_gradient(model)
    x = tf.constant(x)
    alphas = tf.linspace(0.0, 1.0, steps)
    path = tf.reshape(alphas[:, None, None, None, None] * x[None], (-1, *x.shape[1:]))

    def run():
        maps = []
        for k in range(classes):
            g = tf.reshape(grad(path, tf.constant(k)), (steps, *x.shape))
            maps.append(tf.reduce_mean(g, 0) * x)
        return tf.stack(maps, 1)

    return run


def _per_class_gradcam(model, layer, x, classes):
    """One compiled gradient of the activation per class (xplique's way), the
    layer's node tapped so that nested backbones work too."""
    from jacobkit.keras.graph import LayerTap
    from jacobkit.problem.targets import find_layer

    tap = LayerTap(model, find_layer(model, layer, with_variables=False))

    @tf.function
    def cam(x, k):
        acts = []
        with tf.GradientTape() as tape:

            def hook(call, args, kwargs):
                a = call(*args, **kwargs)
                tape.watch(a)
                acts.append(a)
                return a

            y = tap(x, False, hook)[:, k]
        grads = tape.gradient(y, acts[0])
        weights = tf.reduce_mean(grads, axis=(1, 2))
        return tf.nn.relu(tf.einsum("bc,bhwc->bhw", weights, acts[0]))

    x = tf.constant(x)
    return lambda: tf.stack([cam(x, tf.constant(k)) for k in range(classes)], 1)


def _tf_keras_vis(model, layer, x, classes):
    from tf_keras_vis.gradcam import Gradcam
    from tf_keras_vis.saliency import Saliency
    from tf_keras_vis.utils.scores import CategoricalScore

    sal, cam = Saliency(model, clone=False), Gradcam(model, clone=False)
    scores = [CategoricalScore([k] * len(x)) for k in range(classes)]
    return (
        lambda: np.stack(
            [sal(s, x, keepdims=False, normalize_map=False) for s in scores], 1
        ),
        lambda: np.stack(
            [
                cam(
                    s,
                    x,
                    penultimate_layer=layer.split("/")[-1],
                    normalize_cam=False,
                    expand_cam=False,
                )
                for s in scores
            ],
            1,
        ),
    )


def _timed(fn):
    start = time.perf_counter()
    out = fn()
    if hasattr(out, "numpy"):
        out.numpy()
    return time.perf_counter() - start


def _race(pairs, rounds):
    """Median steady seconds of each callable, alternating (each called once
    before, to trace)."""
    for fn in pairs.values():
        fn()
    times = {name: [] for name in pairs}
    for _ in range(rounds):
        for name, fn in pairs.items():
            times[name].append(_timed(fn))
    return {name: statistics.median(t) for name, t in times.items()}


def _diff(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def measure(name, model, layer, x, classes, rounds, steps):
    rows = []
    mine_sal = lambda: explain.saliency(model, x)  # noqa: E731
    xq_sal = _per_class_saliency(model, x, classes)
    mine_cam = lambda: explain.grad_cam(model, x, layer, resize=False)  # noqa: E731
    mine_ig = lambda: explain.integrated_gradients(model, x, steps=steps).maps  # noqa: E731
    xq_ig = _per_class_ig(model, x, classes, steps)
    xq_cam = _per_class_gradcam(model, layer, x, classes)
    vis_sal, vis_cam = _tf_keras_vis(model, layer, x, classes)
    checks = {
        "saliency": _diff(mine_sal(), xq_sal()),
        "saliency (tf-keras-vis)": _diff(mine_sal(), vis_sal()),
        "integrated gradients": _diff(mine_ig(), xq_ig()),
        "Grad-CAM": _diff(mine_cam(), xq_cam()),
    }
    try:
        checks["Grad-CAM (tf-keras-vis)"] = _diff(mine_cam(), vis_cam())
    except Exception as err:  # nested backbones: tf-keras-vis cannot reach them
        checks["Grad-CAM (tf-keras-vis)"] = f"failed: {type(err).__name__}"
        vis_cam = None
    for method, mine, theirs in [
        ("saliency", mine_sal, {"per class": xq_sal, "tf-keras-vis": vis_sal}),
        (
            "Grad-CAM",
            mine_cam,
            {"per class": xq_cam, **({"tf-keras-vis": vis_cam} if vis_cam else {})},
        ),
        (f"integrated gradients ({steps} steps)", mine_ig, {"per class": xq_ig}),
    ]:
        t = _race({"explain": mine, **theirs}, rounds)
        rows.append({"model": name, "method": method, "times_s": t})
    return {
        "model": name,
        "classes": classes,
        "batch": len(x),
        "rows": rows,
        "max_rel_diff": checks,
    }


def _xplique() -> str:
    try:
        import xplique  # noqa: F401
    except Exception as err:  # pins tensorflow<=2.20: not installable here
        return f"not importable ({type(err).__name__}); it pins tensorflow<=2.20"
    return f"xplique {xplique.__version__}"


def report(results, machine):
    lines = [
        "# All-class attributions: `jacobkit.explain` against one call per class",
        "",
        f"Machine: {machine}. Steady seconds per call (median of alternating "
        "rounds, each traced first); speed-up = the other's time / explain's. "
        "'per class' is one compiled batched gradient per class, as xplique "
        f"computes it; xplique itself: {_xplique()}.",
        "",
        "| model | method | explain | other | other's time | speed-up |",
        "|---|---|---:|---|---:|---:|",
    ]
    for res in results:
        for row in res["rows"]:
            t = row["times_s"]
            for other, s in t.items():
                if other == "explain":
                    continue
                lines.append(
                    f"| {res['model']} (B={res['batch']}, K={res['classes']}) | "
                    f"{row['method']} | {t['explain'] * 1e3:.1f} ms | {other} | "
                    f"{s * 1e3:.1f} ms | {s / t['explain']:.2f}x |"
                )
    lines += ["", "Agreement (max relative difference, explain against the other):", ""]
    for res in results:
        for k, v in res["max_rel_diff"].items():
            shown = f"{v:.1e}" if isinstance(v, float) else v
            lines.append(f"- {res['model']}, {k}: {shown}")
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench-explain")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--classes", type=int, default=5)
    args = parser.parse_args(argv)
    results = []
    for name, build in [("small CNN", _cnn), ("frozen MobileNetV2", _mobilenet)]:
        model, layer, x = build(args.classes)
        results.append(
            measure(name, model, layer, x, args.classes, args.rounds, args.steps)
        )
    machine = f"{platform.processor() or platform.machine()}, TF {tf.__version__}"
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "explain.json"), "w") as f:
        json.dump({"machine": machine, "results": results}, f, indent=1)
    text = report(results, machine)
    with open(os.path.join(args.out, "explain.md"), "w") as f:
        f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
