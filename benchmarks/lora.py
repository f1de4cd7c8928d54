"""The DP clipped sum over a LoRA GPT-2's trainable variables (issue 49):
the closed forms (``strategy="batch"``) against ``chunked`` (what ran there
before LoRA had rules), and one plain summed-gradient step of the same
variables, paired in one process.

The model: keras_hub's ``GPT2CausalLM`` on a random-init ``GPT2Backbone``
(vocabulary 1,000, 2 layers, hidden 64, 4 heads, feed-forward 256,
sequences of 32 tokens, batch 16) after ``backbone.enable_lora(4)``: the
query and value projections' factors and biases are the trainable variables,
everything else frozen. Each example's loss is its mean next-token
cross-entropy.

First calls (tracing and checks included) are timed once each, in the
order of the table, after one eager forward and backward pass of the model:
the first, ``batch``'s, also makes the traced pass jacobkit keeps per model
and the later ones reuse (run after ``chunked``, ``batch``'s first call took
4.7 s against ``chunked``'s 4.9 s).
Every round times ``--calls`` calls of each side (the order rotating) and
takes the ratios of their medians to ``batch``'s; the table gives the
median ratio over the rounds with its bootstrap interval, and each side's
median time. A busy machine slows every side of a round alike. ``auto``'s
choice is printed too.

    python benchmarks/lora.py --out benchmarks/results/cpu
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

BATCH, LENGTH, VOCABULARY, RANK, CLIP = 16, 32, 1000, 4, 1.0


def build() -> tuple[Any, Any, Any]:
    """``(model, (x, y), loss)``: the LoRA GPT-2 and one batch."""
    import keras
    import keras_hub
    import numpy as np

    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=VOCABULARY,
        num_layers=2,
        num_heads=4,
        hidden_dim=64,
        intermediate_dim=256,
        max_sequence_length=LENGTH,
    )
    model = keras_hub.models.GPT2CausalLM(backbone, preprocessor=None)
    backbone.enable_lora(RANK)
    rng = np.random.default_rng(0)
    for variable in model.trainable_variables:  # B starts at zero: not here
        variable.assign(rng.normal(scale=0.1, size=variable.shape).astype("float32"))
    ids = rng.integers(1, VOCABULARY, (BATCH, LENGTH + 1)).astype("int32")
    x = {"token_ids": ids[:, :-1], "padding_mask": np.ones((BATCH, LENGTH), "int32")}

    def loss(y_true: Any, y_pred: Any) -> Any:
        tokens = keras.losses.sparse_categorical_crossentropy(
            y_true, y_pred, from_logits=True
        )
        return keras.ops.mean(tokens, axis=-1)

    return model, (x, ids[:, 1:]), loss


def sides(model: Any, data: Any, loss: Any) -> dict[str, Callable[[], Any]]:
    import numpy as np
    import tensorflow as tf

    import jacobkit as jk

    variables = model.trainable_variables

    def clipped(strategy: str) -> Callable[[], Any]:
        def call() -> Any:
            found = jk.jacobian(
                model,
                data,
                variables,
                outputs=jk.Loss(loss),
                reduce=jk.ClippedSum(CLIP),
                strategy=strategy,
            )
            return [np.asarray(v) for v in found.values()]

        return call

    @tf.function
    def step(x: Any, y: Any) -> Any:
        with tf.GradientTape() as tape:
            total = tf.reduce_sum(loss(y, model(x)))
        return tape.gradient(total, variables)

    def plain() -> Any:
        return [np.asarray(g) for g in step(*data)]

    return {"batch": clipped("batch"), "chunked": clipped("chunked"), "plain": plain}


def measure(rounds: int, calls: int) -> dict:
    import numpy as np
    import tensorflow as tf

    import jacobkit as jk
    from jacobkit.bench import stats

    model, data, loss = build()
    found = sides(model, data, loss)
    # the process's first TensorFlow work (eager forward and backward
    # passes) before the first calls, which would otherwise fall on the
    # first side timed
    with tf.GradientTape() as tape:
        total = tf.reduce_sum(loss(data[1], model(data[0])))
    tape.gradient(total, model.trainable_variables)
    first = {}
    for name, call in found.items():
        start = time.perf_counter()
        call()
        first[name] = time.perf_counter() - start
        call()
    auto = jk.jacobian(
        model,
        data,
        model.trainable_variables,
        outputs=jk.Loss(loss),
        reduce=jk.ClippedSum(CLIP),
    )
    agree = max(
        float(np.abs(a - b).max() / (np.abs(b).max() + 1e-30))
        for a, b in zip(found["batch"](), found["chunked"](), strict=True)
    )
    times: dict[str, list[float]] = {name: [] for name in found}
    ratios: dict[str, list[float]] = {"chunked": [], "plain": []}
    names = list(found)
    for round_ in range(rounds):
        order = names[round_ % len(names) :] + names[: round_ % len(names)]
        medians = {}
        for name in order:
            each = []
            for _ in range(calls):
                start = time.perf_counter()
                found[name]()
                each.append(time.perf_counter() - start)
            medians[name] = float(np.median(each))
            times[name].append(medians[name])
        for name in ratios:
            ratios[name].append(medians[name] / medians["batch"])
    summary = {name: stats.ratios(values) for name, values in ratios.items()}
    return {
        "parameters": int(sum(np.prod(v.shape) for v in model.trainable_variables)),
        "auto": auto.strategy,
        "agreement": agree,
        "first_s": first,
        "median_ms": {n: 1e3 * float(np.median(t)) for n, t in times.items()},
        "ratio_to_batch": {
            n: {"median": s.median, "low": s.low, "high": s.high, "rounds": s.n}
            for n, s in summary.items()
        },
    }


def markdown(data: dict, machine: str) -> str:
    ms, ratio = data["median_ms"], data["ratio_to_batch"]
    about = __doc__.split("\n\n")[1].replace("``", "`")
    lines = [
        "# The clipped sum on a LoRA GPT-2",
        "",
        f"`benchmarks/lora.py`: {about}",
        "",
        f"Machine: {machine}. Trainable parameters: {data['parameters']:,}. "
        f"`auto` ran `{data['auto']}`. `batch` against `chunked`: largest "
        f"difference {data['agreement']:.1e} of the largest value.",
        "",
        "| clipped sum by | first call (s) | steady (ms) "
        "| ÷ batch (median, 95% interval) |",
        "|---|---:|---:|---|",
        f"| `batch` (the LoRA rules) | {data['first_s']['batch']:.2f} | "
        f"{ms['batch']:.1f} | 1 |",
    ]
    labels = {"chunked": "`chunked`", "plain": "plain step (no clipping)"}
    for name, label in labels.items():
        r = ratio[name]
        lines.append(
            f"| {label} | {data['first_s'][name]:.2f} | {ms[name]:.1f} | "
            f"{r['median']:.2f} ({r['low']:.2f}-{r['high']:.2f}, "
            f"{r['rounds']} rounds) |"
        )
    lines += [
        "",
        "First calls in the order of the table, after one eager pass: the "
        "first also makes the traced pass jacobkit keeps per model, which "
        "the others reuse (run after `chunked`, `batch`'s took 4.7 s against "
        "`chunked`'s 4.9 s). Ratios: the median over rounds of each round's "
        "median against `batch`'s in the same round.",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--machine", default="")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    data = measure(args.rounds, args.calls)
    text = markdown(data, args.machine or "not given")
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "lora.json").write_text(json.dumps(data, indent=1) + "\n")
        (args.out / "lora.md").write_text(text)


if __name__ == "__main__":
    main()
