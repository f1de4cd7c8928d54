"""keras_hub's ``GPT2CausalLM`` under Hugging Face's names and layouts
(``GPT2LMHeadModel``), for the reductions benchmark's ``gpt2`` case, so that
the PyTorch peer (``reductions_torch.py``) differentiates the very same
function and maps its gradients by the very same projection maps.

Which elements of which Hugging Face parameter each keras_hub variable is
comes from keras_hub's own converter (``convert_gpt2.convert_weights``, Hugging
Face -> Keras), run on index arrays instead of weights: one Hugging Face
parameter can hold several Keras variables (``c_attn`` the query, key and
value kernels, each ``(hidden, heads, head_dim)``), so a variable is an index
array of its Keras shape into its parameter's flattened elements.

Used on jacobkit's side (``export_reductions.py --case gpt2``).
"""

from __future__ import annotations

from typing import Any

import numpy as np


def views(backbone: Any, shapes: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    """Each variable of ``backbone`` (by its path) -> ``(name, index)``: the
    Hugging Face parameter it is part of (``GPT2LMHeadModel``'s name, e.g.
    ``transformer.h.0.attn.c_attn.weight``) and an int64 array of the
    variable's Keras shape holding, per element, its position in that
    parameter's flattened elements. ``shapes``: every Hugging Face
    parameter's shape (``export_gpt2.hf_weights``'s arrays)."""
    from keras_hub.src.utils.transformers import convert_gpt2

    found: dict[str, tuple[str, np.ndarray]] = {}

    class Recorder:
        """keras_hub's loader, in part: hands out index arrays and records
        what each variable would be assigned."""

        def get_tensor(self, key: str) -> np.ndarray:
            shape = shapes["transformer." + key]
            return np.arange(int(np.prod(shape)), dtype="int64").reshape(shape)

        def port_weight(
            self, keras_variable: Any, hf_weight_key: str, hook_fn: Any = None
        ) -> None:
            tensor = self.get_tensor(hf_weight_key)
            shape = list(keras_variable.shape)
            index = hook_fn(tensor, shape) if hook_fn else tensor
            found[keras_variable.path] = (
                "transformer." + hf_weight_key,
                np.asarray(index, "int64").reshape(shape),
            )

    convert_gpt2.convert_weights(backbone, Recorder(), {"n_embd": backbone.hidden_dim})
    return found


def to_hf(
    views: dict[str, Any],
    shapes: dict[str, tuple[int, ...]],
    arrays: dict[str, np.ndarray],
) -> dict[str, np.ndarray]:
    """Keras-layout arrays (by variable path, each of its variable's shape:
    weights, or jacobkit's clipped sums) -> Hugging Face's parameters, every
    element of every parameter written exactly once (checked)."""
    out = {name: np.zeros(shape, "float32") for name, shape in shapes.items()}
    written = {
        name: np.zeros(int(np.prod(shape)), "int64") for name, shape in shapes.items()
    }
    for path, array in arrays.items():
        name, index = views[path]
        out[name].reshape(-1)[index.reshape(-1)] = np.asarray(array).reshape(-1)
        np.add.at(written[name], index.reshape(-1), 1)
    wrong = [name for name, count in written.items() if not np.all(count == 1)]
    if wrong:
        raise SystemExit(f"gpt2_layout: not written exactly once: {wrong}")
    return out
