"""Write the token-attribution benchmark's GPT-2, its prompt, the tokens it
generates and jacobkit's attributions (``jacobkit.explain``) to an ``.npz``,
so the PyTorch anchor (``tokens_torch.py``) runs the very same model through
Hugging Face's ``GPT2LMHeadModel`` and captum, and checks that it computes
the same numbers.

The setup: keras_hub's ``GPT2CausalLM`` (``preprocessor=None``) on a
``GPT2Backbone(vocabulary_size=1000, num_layers=2, num_heads=4,
hidden_dim=64, intermediate_dim=128, max_sequence_length=128)``, randomly
initialised after ``keras.utils.set_random_seed(0)``; batch 1, a prompt of 64
tokens drawn by ``np.random.default_rng(0)``; 32 tokens generated greedily
by ``explain.generate_and_attribute``, each attributed to every earlier token.

The file holds every weight under the name of the Hugging Face GPT-2
parameter it is (``transformer.wte.weight``, ``transformer.h.0.attn.c_attn
.weight``, ...; ``GPT2LMHeadModel``'s ``state_dict`` keys, ``lm_head.weight``
left out: it is tied to ``transformer.wte.weight``), in Hugging Face's
layouts (its ``Conv1D`` kernels are ``(in, out)`` as Keras's; the query, key
and value kernels ``(hidden, heads, head_dim)`` flattened and concatenated
into ``c_attn``, the inverse of keras_hub's ``convert_gpt2.py``); the model's
shape (``vocabulary_size``, ``num_layers``, ``num_heads``, ``hidden_dim``,
``intermediate_dim``, ``max_sequence_length``, ``layer_norm_epsilon``);
``prompt`` ``(1, 64)``, ``tokens`` ``(1, 96)`` (the prompt and the generated
tokens), ``logits`` ``(1, 96, 1000)`` (the Keras model's on ``tokens``) and,
per method ``M`` in ``gradient`` and ``gradient_x_input``, ``scores_M``
``(1, 32, 96)`` float64 (jacobkit's: row ``k`` is position ``63 + k``'s
log-probability of the token it generated, against every token; zero from
position ``64 + k`` on) and ``seconds_M`` (the wall time of that
``generate_and_attribute`` call, generation included, for information only).

    python benchmarks/peers/export_gpt2.py --out /tmp/gpt2.npz
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# the benchmarks' folder, for the models' sizes
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import keras  # noqa: E402
import keras_hub  # noqa: E402
import model_configs  # noqa: E402
import numpy as np  # noqa: E402

from jacobkit import explain  # noqa: E402

CONFIG = model_configs.GPT2
#: keras_hub's GPT-2 layer norms (``GPT2Backbone``'s, fixed)
EPSILON = 1e-5
PROMPT, NEW_TOKENS = 64, 32
METHODS = ("gradient", "gradient_x_input")


def build(seed: int) -> Any:
    """The randomly initialised ``GPT2CausalLM``, no preprocessor."""
    keras.utils.set_random_seed(seed)
    backbone = keras_hub.models.GPT2Backbone(**CONFIG)
    return keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)


def hf_weights(backbone: Any) -> dict[str, np.ndarray]:
    """Every weight of ``backbone`` under its Hugging Face GPT-2 name, in
    Hugging Face's layout (the inverse of keras_hub's ``convert_gpt2.py``)."""

    def value(variable: Any) -> np.ndarray:
        return np.asarray(keras.ops.convert_to_numpy(variable), "float32")

    hidden = backbone.hidden_dim
    found = {
        "transformer.wte.weight": value(backbone.token_embedding.embeddings),
        "transformer.wpe.weight": value(
            backbone.position_embedding.position_embeddings
        ),
        "transformer.ln_f.weight": value(backbone.layer_norm.gamma),
        "transformer.ln_f.bias": value(backbone.layer_norm.beta),
    }
    for index, layer in enumerate(backbone.transformer_layers):
        name = f"transformer.h.{index}"
        attention = layer._self_attention_layer
        dense = (attention.query_dense, attention.key_dense, attention.value_dense)
        found.update(
            {
                f"{name}.ln_1.weight": value(layer._self_attention_layer_norm.gamma),
                f"{name}.ln_1.bias": value(layer._self_attention_layer_norm.beta),
                f"{name}.ln_2.weight": value(layer._feedforward_layer_norm.gamma),
                f"{name}.ln_2.bias": value(layer._feedforward_layer_norm.beta),
                # (hidden, heads, head_dim) each -> (hidden, 3 * hidden)
                f"{name}.attn.c_attn.weight": np.concatenate(
                    [value(d.kernel).reshape(hidden, hidden) for d in dense], axis=1
                ),
                f"{name}.attn.c_attn.bias": np.concatenate(
                    [value(d.bias).reshape(hidden) for d in dense]
                ),
                # (heads, head_dim, hidden) -> (hidden, hidden)
                f"{name}.attn.c_proj.weight": value(
                    attention.output_dense.kernel
                ).reshape(hidden, hidden),
                f"{name}.attn.c_proj.bias": value(attention.output_dense.bias),
                f"{name}.mlp.c_fc.weight": value(
                    layer._feedforward_intermediate_dense.kernel
                ),
                f"{name}.mlp.c_fc.bias": value(
                    layer._feedforward_intermediate_dense.bias
                ),
                f"{name}.mlp.c_proj.weight": value(
                    layer._feedforward_output_dense.kernel
                ),
                f"{name}.mlp.c_proj.bias": value(layer._feedforward_output_dense.bias),
            }
        )
    count = sum(int(np.prod(v.shape)) for v in backbone.weights)
    exported = sum(v.size for v in found.values())
    if count != exported:
        raise SystemExit(
            f"export_gpt2: exported {exported} weights of the backbone's {count}"
        )
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="gpt2.npz")
    parser.add_argument("--seed", type=int, default=0, help="of the weights")
    parser.add_argument("--prompt-seed", type=int, default=0)
    args = parser.parse_args()
    model = build(args.seed)
    rng = np.random.default_rng(args.prompt_seed)
    ids = rng.integers(0, CONFIG["vocabulary_size"], (1, PROMPT)).astype("int32")
    prompt = {"token_ids": ids, "padding_mask": np.ones_like(ids)}
    arrays: dict[str, Any] = {
        **hf_weights(model.backbone),
        **{k: np.asarray(v) for k, v in CONFIG.items()},
        "layer_norm_epsilon": np.asarray(EPSILON),
        "prompt": ids,
    }
    tokens = None
    for method in METHODS:
        start = time.perf_counter()
        found, attribution = explain.generate_and_attribute(
            model, prompt, new_tokens=NEW_TOKENS, method=method
        )
        seconds = time.perf_counter() - start
        if tokens is not None and not np.array_equal(found, tokens):
            raise SystemExit("export_gpt2: the methods generated different tokens")
        tokens = found
        arrays[f"scores_{method}"] = attribution.scores.astype("float64")
        arrays[f"seconds_{method}"] = np.asarray(seconds)
        print(f"export_gpt2: {method}: {seconds:.2f} s, generation included")
    assert tokens is not None
    inputs = {"token_ids": tokens, "padding_mask": np.ones_like(tokens)}
    arrays["tokens"] = tokens
    arrays["logits"] = np.asarray(model(inputs, training=False), "float32")
    np.savez(args.out, **arrays)
    print(f"export_gpt2: wrote {args.out}: tokens {tokens.shape}")


if __name__ == "__main__":
    main()
