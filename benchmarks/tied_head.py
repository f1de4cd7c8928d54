"""A causal LM's clipped sum with its tied head on the closed forms (issue
49): keras_hub ``GPT2CausalLM`` (random init, every trainable variable,
per-example mean next-token loss), ``reduce=jk.ClippedSum(1.0)``:

- ``batch`` (what ``auto`` runs now) against ``chunked(16)`` (what it ran
  before: the token table had no closed form, so the reduced plan fell to
  the generic strategy), paired in one process: rounds alternate the two,
  the figure is the median of each one's steady calls and the median
  per-round ratio;
- the table's norms on ``batch`` (``reduce="norm"``, the table alone) in
  the Gram form (both calls together, ``(B, K, P, P)`` held) against its
  per-example ``(vocabulary, D)`` tables formed, paired likewise, at a few
  sequence lengths: where :func:`jacobkit.layers.norms.use_gram` puts the
  crossover.

    python benchmarks/tied_head.py --out benchmarks/results/cpu

Writes ``tied_head.md`` and ``tied_head.json`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

ROUNDS = 7
CALLS = 3


def _model(vocabulary: int, hidden: int, length: int, batch: int) -> tuple:
    import keras
    import keras_hub
    import numpy as np

    import jacobkit as jk

    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=vocabulary,
        num_layers=2,
        num_heads=4,
        hidden_dim=hidden,
        intermediate_dim=4 * hidden,
        max_sequence_length=length,
        dropout=0.0,
    )
    model = keras_hub.models.GPT2CausalLM(backbone, preprocessor=None)
    rng = np.random.default_rng(0)
    x = {
        "token_ids": rng.integers(1, vocabulary, (batch, length)).astype("int32"),
        "padding_mask": np.ones((batch, length), "int32"),
    }
    y = np.roll(x["token_ids"], -1, axis=1)

    def loss(y_true: Any, y_pred: Any) -> Any:
        tokens = keras.losses.sparse_categorical_crossentropy(
            y_true, y_pred, from_logits=True
        )
        return keras.ops.mean(tokens, axis=-1)

    return model, (x, y), jk.Loss(loss)


def _paired(calls: dict[str, Any]) -> dict[str, Any]:
    """Each call's first call, then ``ROUNDS`` rounds alternating them,
    ``CALLS`` steady calls each: medians and the per-round ratio of the
    second to the first."""
    first = {}
    for name, call in calls.items():
        start = time.perf_counter()
        call()
        first[name] = time.perf_counter() - start
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(ROUNDS):
        for name, call in calls.items():
            each = []
            for _ in range(CALLS):
                start = time.perf_counter()
                call()
                each.append(time.perf_counter() - start)
            times[name].append(statistics.median(each))
    one, two = list(calls)
    ratios = [b / a for a, b in zip(times[one], times[two], strict=True)]
    return {
        "first_s": first,
        "steady_ms": {n: 1e3 * statistics.median(t) for n, t in times.items()},
        "ratio": statistics.median(ratios),
        "ratio_range": [min(ratios), max(ratios)],
    }


def clipped_sum() -> dict[str, Any]:
    import jacobkit as jk

    model, inputs, loss = _model(2000, 64, 32, 16)
    variables = model.trainable_variables

    def run(strategy: Any) -> Any:
        return lambda: jk.jacobian(
            model,
            inputs,
            variables,
            outputs=loss,
            reduce=jk.ClippedSum(1.0),
            strategy=strategy,
        )

    chunked = jk.strategies.Chunked(chunk_size=16)
    found = _paired({"batch": run("batch"), "chunked(16)": run(chunked)})
    auto = jk.jacobian(
        model, inputs, variables, outputs=loss, reduce=jk.ClippedSum(1.0)
    ).strategy
    return {"auto runs": auto, **found}


def table_norms(length: int) -> dict[str, Any]:
    import jacobkit as jk
    from jacobkit.layers import embedding
    from jacobkit.layers import norms as layer_norms

    default = layer_norms.CHUNK_ELEMENTS, embedding.TIED_GRAM_WEIGHT

    def run(chunk: int, weight: float) -> Any:
        # a model each: the compiled computations are kept per problem
        model, inputs, loss = _model(2000, 64, length, 16)
        table = model.backbone.token_embedding.embeddings

        def call() -> Any:
            # read while the computation is traced (its first call) only
            layer_norms.CHUNK_ELEMENTS, embedding.TIED_GRAM_WEIGHT = chunk, weight
            try:
                return jk.jacobian(
                    model,
                    inputs,
                    [table],
                    outputs=loss,
                    reduce="norm",
                    strategy="batch",
                )
            finally:
                layer_norms.CHUNK_ELEMENTS, embedding.TIED_GRAM_WEIGHT = default

        return call

    # formed: 16 x 2000 x 64 = 2 M numbers, within one chunk, the Gram form
    # weighted out of use_gram; the Gram form forced by a chunk of one number
    return _paired({"formed": run(2**30, 1e9), "gram form": run(1, 1.0)})


def _cpu() -> str:
    """The CPU's model name (Linux), or ``"CPU"``."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return "CPU"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/cpu")
    parser.add_argument("--lengths", default="8,32,128")
    parser.add_argument("--no-clipped", action="store_true")
    args = parser.parse_args()
    rows = {} if args.no_clipped else {"clipped sum": clipped_sum()}
    print(rows, flush=True)
    for length in (int(n) for n in args.lengths.split(",")):
        rows[f"table norms, {length} tokens"] = table_norms(length)
        print(length, rows[f"table norms, {length} tokens"], flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tied_head.json").write_text(json.dumps(rows, indent=1))
    lines = [
        "# A causal LM's tied head on the closed forms",
        "",
        "Written by `benchmarks/tied_head.py` (see its docstring): keras_hub "
        "`GPT2CausalLM`, vocabulary 2,000, width 64, 2 layers, 16 examples; "
        f"steady calls the median of {CALLS} per round, {ROUNDS} alternating "
        "rounds in one process; the ratio the median per-round ratio (its "
        "range over the rounds).",
        "",
        "| case | first calls (s) | steady (ms) | ratio (range) |",
        "|---|---|---|---|",
    ]
    for case, found in rows.items():
        names = list(found["steady_ms"])
        first = ", ".join(f"{n} {found['first_s'][n]:.1f}" for n in names)
        steady = ", ".join(f"{n} {found['steady_ms'][n]:.1f}" for n in names)
        low, high = found["ratio_range"]
        ratio = f"{names[1]} / {names[0]}: {found['ratio']:.2f} ({low:.2f}-{high:.2f})"
        lines.append(f"| {case} | {first} | {steady} | {ratio} |")
    load = os.getloadavg()[0]
    lines += [
        "",
        f"{_cpu()}, {os.cpu_count()} cores, load average {load:.1f} at the end.",
    ]
    if "clipped sum" in rows:
        lines += ["", f"`auto` runs `{rows['clipped sum']['auto runs']}`."]
    (out / "tied_head.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
