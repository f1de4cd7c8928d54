"""How far the closed forms reach on the models users load: ``jk.coverage``
on keras_hub BERT, GPT-2, Gemma and ViT and the GPT-2 and Gemma causal LMs
(tiny configurations, random weights) and keras.applications ResNet50,
MobileNetV2, ConvNeXtTiny and DenseNet121 (random weights, 32 px, the whole
backbone trainable), for per-example rows. Writes ``coverage.md`` (and
``coverage.json``) to ``--out``; ``--only NAME`` (repeated) reruns those
models and keeps the other rows of ``--out``'s ``coverage.json``.

    python benchmarks/coverage.py --out benchmarks/results/cpu

About 15 minutes on 2 cores: each layer is checked as a call would check
it, one traced pass of the whole model each.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import model_configs

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


def models() -> dict:
    import keras
    import keras_hub
    import numpy as np

    rng = np.random.default_rng(0)

    def tokens(segment: bool = False) -> dict:
        x = {
            "token_ids": rng.integers(1, 50, (2, 8)).astype("int32"),
            "padding_mask": np.ones((2, 8), "int32"),
        }
        if segment:
            x["segment_ids"] = np.zeros((2, 8), "int32")
        return x

    text = model_configs.tiny_text(16)
    image = rng.normal(size=(2, 32, 32, 3)).astype("float32")

    def gemma() -> object:
        # Gemma's heads are its own: queries, and keys and values shared
        sizes = {k: v for k, v in model_configs.TINY_TEXT.items() if k != "num_heads"}
        return keras_hub.models.GemmaBackbone(
            **sizes, num_query_heads=2, num_key_value_heads=1, head_dim=8
        )

    found = {
        "keras_hub BERT": (
            keras_hub.models.BertBackbone(**text),
            tokens(True),
            "sequence_output",
        ),
        "keras_hub GPT-2": (
            keras_hub.models.GPT2Backbone(**text),
            tokens(),
            None,
        ),
        "keras_hub Gemma": (gemma(), tokens(), None),
        # the backbones above, each under its head tied to its token table
        "keras_hub GPT2CausalLM": (
            keras_hub.models.GPT2CausalLM(
                keras_hub.models.GPT2Backbone(**text),
                preprocessor=None,
            ),
            tokens(),
            None,
        ),
        "keras_hub GemmaCausalLM": (
            keras_hub.models.GemmaCausalLM(gemma(), preprocessor=None),
            tokens(),
            None,
        ),
        "keras_hub ViT": (
            keras_hub.models.ViTBackbone(
                image_shape=(32, 32, 3),
                patch_size=8,
                num_layers=2,
                num_heads=2,
                hidden_dim=16,
                mlp_dim=32,
            ),
            image,
            None,
        ),
    }
    for name, build in (
        ("ResNet50", keras.applications.ResNet50),
        ("MobileNetV2", keras.applications.MobileNetV2),
        ("ConvNeXtTiny", keras.applications.ConvNeXtTiny),
        ("DenseNet121", keras.applications.DenseNet121),
    ):
        backbone = build(weights=None, include_top=False, input_shape=(32, 32, 3))
        found[f"keras.applications {name}"] = (backbone, image, None)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/cpu")
    parser.add_argument("--only", action="append", default=[])
    args = parser.parse_args()
    import jacobkit as jk

    kept = Path(args.out) / "coverage.json"
    earlier = (
        {r["model"]: r for r in json.loads(kept.read_text())}
        if args.only and kept.exists()
        else {}
    )
    rows = []
    for name, (model, x, output) in models().items():
        if args.only and name not in args.only:
            if name in earlier:
                rows.append(earlier[name])
            continue
        start = time.perf_counter()
        found = jk.coverage(model, x, output=output)
        seconds = time.perf_counter() - start
        rows.append(
            {
                "model": name,
                "share": found.share,
                "parameters": found.parameters,
                "layers": len(found.layers),
                "generic": [
                    {"path": e.path, "class": e.class_name, "reason": e.reason}
                    for e in found.generic
                ],
                "seconds": seconds,
            }
        )
        print(f"{name}: {found.summary()} ({seconds:.0f} s)", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "coverage.json").write_text(json.dumps(rows, indent=1))
    lines = [
        "# How far the closed forms reach",
        "",
        "`jk.coverage(model, x)` (per-example rows) on each model: the share of "
        "its trainable parameters (by variables' sizes) whose layer a per-layer "
        "closed form serves, as the `batch` strategy checks it before running. "
        "Written by `benchmarks/coverage.py`.",
        "",
        "| model | trainable layers | parameters | closed form | not served |",
        "|---|---:|---:|---:|---|",
    ]
    for r in rows:
        generic = "; ".join(f"{g['path']} ({g['class']})" for g in r["generic"])
        lines.append(
            f"| {r['model']} | {r['layers']} | {r['parameters']:,} | "
            f"{r['share']:.1%} | {generic or 'none'} |"
        )
    (out / "coverage.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
