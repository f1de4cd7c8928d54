"""A plan per group of targets (issue 49) against the whole model on a
generic strategy, every trainable variable, per-example loss rows: an
Embedding -> LSTM -> Dense -> Dense classifier, where the LSTM has no closed
form (``--model lstm``), and a conv net with a user's layer with weights
between its convolutions (``--model conv``).

- ``grouped``: what ``auto`` plans, ``batch`` on the embedding and the two
  Dense layers, ``chunked(16)`` on the LSTM, in one compiled call;
- ``generic``: ``chunked(16)`` on every target (what ``auto`` ran before).

Both for the rows (``reduce=None``) and the DP clipped sum
(``jk.ClippedSum(1.0)``), paired in one process: each round calls each
strategy once, alternating which goes first; the figure is the median per
round of the steady calls' time, and the ratio the median of the rounds'
ratios (a round's slowdown on a shared machine falls on both alike). The
first call (tracing included) is reported once.

    python benchmarks/grouped.py --rounds 11 --model lstm
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import keras
import numpy as np

import jacobkit as jk
from jacobkit.strategies import Chunked, Grouped

LOSS = jk.Loss(
    keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
)


def model_and_batch(batch: int) -> tuple[keras.Model, Any]:
    """The classifier (a 5,000-token vocabulary: the embedding holds most
    of its 400k parameters), random init, and one batch of 20 tokens."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((20,), dtype="int32"),
            keras.layers.Embedding(5000, 64, name="embed"),
            keras.layers.LSTM(32, name="lstm"),
            keras.layers.Dense(128, activation="relu", name="hidden"),
            keras.layers.Dense(10, name="head"),
        ]
    )
    rng = np.random.default_rng(0)
    x = rng.integers(0, 5000, (batch, 20)).astype("int32")
    y = rng.integers(0, 10, batch)
    return model, (x, y)


@keras.saving.register_keras_serializable("jacobkit_benchmarks")
class Gain(keras.layers.Layer):
    """A user's layer with weights and no rule (per-channel gain)."""

    def build(self, input_shape: Any) -> None:
        self.w = self.add_weight(shape=(input_shape[-1],), initializer="ones", name="w")

    def call(self, x: Any) -> Any:
        return x * self.w + 0.1 * keras.ops.sin(x) * self.w


def conv_and_batch(batch: int) -> tuple[keras.Model, Any]:
    """A conv net (32 x 32 x 3 images) with a user's layer between its
    convolutions; 16 channels, a Dense(128) and a Dense(10) head."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((32, 32, 3)),
            keras.layers.Conv2D(16, 3, activation="relu", name="conv"),
            Gain(name="gain"),
            keras.layers.Conv2D(16, 3, strides=2, activation="relu", name="conv2"),
            keras.layers.Flatten(),
            keras.layers.Dense(128, activation="relu", name="hidden"),
            keras.layers.Dense(10, name="head"),
        ]
    )
    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch, 32, 32, 3)).astype("float32")
    return model, (x, rng.integers(0, 10, batch))


MODELS = {"lstm": model_and_batch, "conv": conv_and_batch}


def _timed(call: Any) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--model", choices=list(MODELS), default="lstm")
    args = parser.parse_args()
    model, inputs = MODELS[args.model](args.batch)
    variables = model.trainable_variables
    print(f"batch {args.batch}, {model.count_params():,} parameters")
    for reduce in (None, jk.ClippedSum(1.0)):
        rest = Chunked(16)
        uncovered = (
            ("lstm/lstm_cell/kernel", "lstm/lstm_cell/recurrent_kernel")
            + ("lstm/lstm_cell/bias",)
            if args.model == "lstm"
            else ("gain/w",)
        )
        strategies = {"grouped": Grouped(rest, uncovered), "generic": rest}

        def call(strategy: Any, reduce: Any = reduce) -> Any:
            return jk.jacobian(
                model, inputs, variables, outputs=LOSS, reduce=reduce, strategy=strategy
            )

        # first calls before auto's, which traces its own plan
        first = {name: _timed(lambda s=s: call(s)) for name, s in strategies.items()}
        planned = call("auto")
        times: dict[str, list[float]] = {name: [] for name in strategies}
        for round_ in range(args.rounds):
            order = list(strategies) if round_ % 2 == 0 else list(strategies)[::-1]
            for name in order:
                times[name].append(_timed(lambda s=strategies[name]: call(s)))
        ratios = [g / c for g, c in zip(times["grouped"], times["generic"])]
        print(f"\nreduce={reduce!r}: auto ran {planned.strategy_config.label}")
        for name in strategies:
            steady = statistics.median(times[name]) * 1e3
            print(
                f"  {name:8s} {strategies[name].label}: first call "
                f"{first[name]:.2f} s, steady {steady:.1f} ms"
            )
        print(f"  grouped / generic, steady: {statistics.median(ratios):.2f}")


if __name__ == "__main__":
    main()
