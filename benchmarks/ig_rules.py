"""Integrated gradients' rules at equal cost: the completeness gap of
``rule="riemann"``, ``"trapezoid"`` and ``"gauss_legendre"`` at the default
steps, on the models users attribute.

Every rule takes the same ``steps`` gradients in the same one
:func:`jacobkit.jacobian` call (only the points on the path and their
weights differ): equal cost by construction, confirmed here by paired
timing on the conv net (alternating rounds, median ratio to riemann). What
differs is how far the attributions miss ``f(x) - f(x0)``: the gap, judged
as the :class:`~jacobkit.explain.CompletenessWarning` judges it
(``relative_gap``: ``|gap|`` over ``|f(x) - f(x0)|``, rows of a change below
1% of the call's largest against that 1%; a warning above 5%).

Models (random init, no download; each over several seeds, zero baseline):

- ``mlp``: ``tests/test_explain.py``'s MLP (``Flatten -> Dense(16, tanh) ->
  Dense(4)`` on 12 x 12 x 3 images, 3 images);
- ``convnet``: its conv net (two ReLU ``Conv2D`` -> pooling -> ``Dense(4)``);
- ``mobilenet``: ``keras.applications.MobileNetV2(alpha=0.35)`` at 32 x 32,
  5 linear classes (ReLU6, batch normalization in inference mode);
- ``bert``, ``gpt2``: keras_hub's ``BertTextClassifier`` (3 classes) and
  ``GPT2CausalLM`` (vocabulary 50, 2 layers, hidden 16, 3 sequences of 8
  tokens), ``explain.token_attribution(method="integrated_gradients")`` at
  its default 16 steps and baseline.

    python benchmarks/ig_rules.py --out benchmarks/results/cpu
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
import warnings
from pathlib import Path

import keras
import model_configs
import numpy as np
import tensorflow as tf

from jacobkit import explain
from jacobkit.explain import completeness

RULES = ("riemann", "trapezoid", "gauss_legendre")
SEEDS = (0, 1, 2)
#: the defaults: integrated_gradients' and token_attribution's
STEPS = {"input": 32, "tokens": 16}
#: the steps of the convergence table
SWEEP = (8, 16, 32, 64)
CLASSES = 4


def _mlp() -> keras.Model:
    inp = keras.Input((12, 12, 3))
    h = keras.layers.Dense(16, activation="tanh")(keras.layers.Flatten()(inp))
    return keras.Model(inp, keras.layers.Dense(CLASSES)(h))


def _convnet() -> keras.Model:
    inp = keras.Input((12, 12, 3))
    h = keras.layers.Conv2D(6, 3, activation="relu")(inp)
    h = keras.layers.Conv2D(8, 3, activation="relu")(h)
    h = keras.layers.GlobalAveragePooling2D()(h)
    return keras.Model(inp, keras.layers.Dense(CLASSES)(h))


def _mobilenet() -> keras.Model:
    return keras.applications.MobileNetV2(
        input_shape=(32, 32, 3),
        alpha=0.35,
        weights=None,
        classes=5,
        classifier_activation=None,
    )


def _images(shape: tuple[int, ...], seed: int) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=shape).astype("float32")


def _tokens(seed: int, segments: bool) -> dict[str, np.ndarray]:
    ids = np.random.default_rng(seed).integers(1, 50, (3, 8)).astype("int32")
    ones = np.ones_like(ids)
    found = {"token_ids": ids, "padding_mask": ones}
    return {**found, "segment_ids": 0 * ones} if segments else found


def _hub(name: str) -> keras.Model:
    import keras_hub

    sizes = model_configs.tiny_text(8)
    if name == "bert":
        backbone = keras_hub.models.BertBackbone(**sizes)
        return keras_hub.models.BertTextClassifier(
            backbone, num_classes=3, preprocessor=None
        )
    backbone = keras_hub.models.GPT2Backbone(**sizes)
    return keras_hub.models.GPT2CausalLM(backbone, preprocessor=None)


MODELS = {
    "mlp": ("input", _mlp, (3, 12, 12, 3)),
    "convnet": ("input", _convnet, (3, 12, 12, 3)),
    "mobilenet": ("input", _mobilenet, (2, 32, 32, 3)),
    "bert": ("tokens", lambda: _hub("bert"), None),
    "gpt2": ("tokens", lambda: _hub("gpt2"), None),
}


def relative_gaps(kind: str, model, x, steps: int, rule: str) -> np.ndarray:  # noqa: ANN001
    """Every row's relative gap, as the warning judges it."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", explain.CompletenessWarning)
        if kind == "input":
            found = explain.integrated_gradients(model, x, steps=steps, rule=rule)
            return np.asarray(found.relative_gap)
        result = explain.token_attribution(
            model, x, method="integrated_gradients", steps=steps, rule=rule
        )
    assert result.gap is not None
    change = result.scores.sum(-1) - result.gap  # f(e) - f(e0), per row
    return completeness.relative_gaps(result.gap, change)


def measure() -> dict:
    found: dict = {}
    for name, (kind, build, shape) in MODELS.items():
        rows: dict = {rule: {} for rule in RULES}
        for seed in SEEDS:
            keras.utils.set_random_seed(seed)
            model = build()
            x = _images(shape, seed) if shape else _tokens(seed, name == "bert")
            for steps in SWEEP:
                for rule in RULES:
                    gaps = relative_gaps(kind, model, x, steps, rule)
                    rows[rule].setdefault(steps, []).append(gaps.ravel().tolist())
        found[name] = {"kind": kind, "default_steps": STEPS[kind], "gaps": rows}
        print(name, {r: _worst(rows[r][STEPS[kind]]) for r in RULES}, flush=True)
    return found


def _worst(per_seed: list[list[float]]) -> float:
    return float(max(max(g) for g in per_seed))


def _median(per_seed: list[list[float]]) -> float:
    return float(statistics.median(v for g in per_seed for v in g))


def cost(rounds: int) -> dict[str, float]:
    """The median time of each rule over riemann's, paired in alternating
    rounds on the conv net (steady: each traced first)."""
    keras.utils.set_random_seed(0)
    model, x = _convnet(), _images((3, 12, 12, 3), 0)
    times: dict[str, list[float]] = {rule: [] for rule in RULES}
    for i in range(rounds + 1):
        for rule in RULES if i % 2 else RULES[::-1]:
            start = time.perf_counter()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", explain.CompletenessWarning)
                explain.integrated_gradients(model, x, steps=32, rule=rule)
            if i:  # round 0 traces
                times[rule].append(time.perf_counter() - start)
    base = statistics.median(times["riemann"])
    return {rule: statistics.median(times[rule]) / base for rule in RULES}


def markdown(found: dict, ratios: dict[str, float]) -> str:
    lines = [
        "# Integrated gradients: the rules' completeness gap at equal cost",
        "",
        "Generated by `benchmarks/ig_rules.py` (its docstring: the models and "
        "the measure). Random-init models, zero baseline (token attribution: "
        "its default baseline), seeds "
        f"{', '.join(map(str, SEEDS))}; TensorFlow {tf.__version__}, Keras "
        f"{keras.__version__}, {platform.machine()}. Measured on a shared "
        "machine under load (the gaps do not depend on it; the cost ratios "
        "are paired in one process).",
        "",
        "Largest relative gap over every row and seed at the default steps "
        "(a `CompletenessWarning` above 5e-02), and the median row's:",
        "",
        "| model | steps | "
        + " | ".join(f"{r} largest | {r} median" for r in RULES)
        + " |",
        "|---|---:|" + "---:|---:|" * len(RULES),
    ]
    for name, data in found.items():
        steps = data["default_steps"]
        cells = []
        for rule in RULES:
            per_seed = data["gaps"][rule][steps]
            cells += [f"{_worst(per_seed):.1e}", f"{_median(per_seed):.1e}"]
        lines.append(f"| {name} | {steps} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Largest relative gap against steps:",
        "",
        "| model | rule | " + " | ".join(str(s) for s in SWEEP) + " |",
        "|---|---|" + "---:|" * len(SWEEP),
    ]
    for name, data in found.items():
        for rule in RULES:
            gaps = data["gaps"][rule]
            cells = [f"{_worst(gaps[s]):.1e}" for s in SWEEP]
            lines.append(f"| {name} | {rule} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Cost: each rule's steady time over riemann's (the conv net, 32 steps, "
        "paired rounds, median): "
        + ", ".join(f"{r} {v:.2f}x" for r, v in ratios.items())
        + ".",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    found = measure()
    ratios = cost(args.rounds)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "ig_rules.json").write_text(
        json.dumps({"gaps": found, "cost": ratios}, indent=1) + "\n"
    )
    (args.out / "ig_rules.md").write_text(markdown(found, ratios))


if __name__ == "__main__":
    main()
