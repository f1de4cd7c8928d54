"""One example through batched matmuls, vectorized over rows
(:mod:`jacobkit.strategies.vectorize`).

TF 2.21's oneDNN batched matmul miscomputes a product that broadcasts an
operand against a size-1 batch axis, and pfor made exactly that of Keras's
``EinsumDense("abc,cd->abd")`` (a rank-3 by rank-2 ``tf.matmul``) for one
example: ``(rows, 1, T, D) @ (D, E)``. On an AMX Xeon with oneDNN, every
vectorizing strategy (``batch`` too) was off by 100% on the model below, or
crashed the process at other sizes. These tests fail there without the
replaced rule; on CPUs without oneDNN they pass either way.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.ops.parallel_for import pfor

import jacobkit as jk
from jacobkit import testing
from jacobkit.strategies import vectorize
from tests.cases import STRATEGIES

#: the registered strategies, each as auto would configure it
REGISTERED = [c for c in STRATEGIES if c.id in jk.strategies.REGISTRY]
#: the refusals expected on this model: (strategy, target) -> the message
REFUSALS = {
    ("batch", "inputs"): "differentiates a Dense or Conv layer's kernel",
    ("structured", "e1"): "no exact shortcut applies",
    ("structured", "inputs"): "no exact shortcut applies",
}


def _sequence_model() -> keras.Model:
    """Two ``EinsumDense`` layers on sequences of 16 steps of 16 features
    (the sizes at which oneDNN's product was wrong rather than fatal)."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((16, 16))
    h = keras.layers.EinsumDense("abc,cd->abd", (None, 16), name="e1")(inputs)
    h = keras.layers.Activation("tanh")(h)
    outputs = keras.layers.EinsumDense("abc,cd->abd", (None, 3), name="e2")(h)
    return keras.Model(inputs, outputs)


@pytest.mark.parametrize("target", ["e1", "inputs"])
@pytest.mark.parametrize("case", REGISTERED, ids=lambda c: c.id)
def test_one_example_through_einsum_dense_agrees_with_float64(case, target):
    """Measured: 1.5e-7 (every strategy, both targets) against float64; the
    tolerance is derived from the obvious loop's own error
    (:func:`jacobkit.testing.assert_close`)."""
    model = _sequence_model()
    x = np.random.default_rng(0).normal(size=(1, 16, 16)).astype("float32")
    layer = jk.Inputs() if target == "inputs" else target
    strategy = case.make(3)
    refusal = REFUSALS.get((strategy.name, target))
    if refusal is not None:
        with pytest.raises(ValueError, match=refusal):
            jk.jacobian(model, x, layer, outputs="per_example", strategy=strategy)
        return
    result = jk.jacobian(model, x, layer, outputs="per_example", strategy=strategy)
    reference = testing.float64_reference(model, x, layer, outputs="per_example")
    testing.assert_close(result, reference)


@pytest.mark.parametrize("case", REGISTERED, ids=lambda c: c.id)
def test_one_prompt_through_keras_hub_attention_agrees_with_float64(case):
    """A keras_hub GPT-2 (hidden 16) on one prompt, at its token embeddings
    (attention's products and its dense layers, vectorized). Measured:
    1.4e-7 (loop 1.9e-7) against float64; the tolerance is derived from
    the obvious loop's own error."""
    from tests import hub_models

    keras.utils.set_random_seed(0)
    model = hub_models.gpt2(hidden=16)
    ids = np.random.default_rng(0).integers(1, 50, (1, 8)).astype("int32")
    x = {"token_ids": ids, "padding_mask": np.ones_like(ids)}
    target = jk.Output("token_embedding")
    kwargs = dict(outputs="per_example", features=(0, 5, 9))
    strategy = case.make(3)
    if strategy.name in ("batch", "structured"):  # kernels, and no shortcut
        with pytest.raises(ValueError, match="Dense or Conv|no exact shortcut"):
            jk.jacobian(model, x, target, strategy=strategy, **kwargs)
        return
    result = jk.jacobian(model, x, target, strategy=strategy, **kwargs)
    testing.assert_close(result, testing.float64_reference(model, x, target, **kwargs))


def _products() -> dict[str, tuple]:
    """Each branch of the replaced rule: ``(fn of one row, rows, the NumPy
    product of one row)``."""
    rng = np.random.default_rng(1)

    def normal(*shape: int) -> np.ndarray:
        return rng.normal(size=shape).astype("float32")

    rows, matrix, square = normal(4, 1, 16, 16), normal(16, 8), normal(16, 16)
    batched, left = normal(1, 16, 8), normal(5, 16)
    doubled, pairs = normal(4, 2, 16, 16), normal(2, 16, 8)
    return {
        # a row times a fixed matrix: one 2-D matmul over the rows
        "row @ matrix": (lambda r: tf.matmul(r, matrix), rows, lambda r: r @ matrix),
        "row^T @ matrix^T": (
            lambda r: tf.matmul(r, square, adjoint_a=True, adjoint_b=True),
            rows,
            lambda r: np.swapaxes(r, -1, -2) @ square.T,
        ),
        # a fixed matrix times a row: one einsum over the rows
        "matrix @ row": (lambda r: tf.matmul(left, r), rows, lambda r: left @ r),
        # a row times a fixed batch of matrices: broadcast explicitly (a
        # size-1 axis), or by the product (none)
        "row @ batch": (lambda r: tf.matmul(r, batched), rows, lambda r: r @ batched),
        "rows of 2 @ batch of 2": (
            lambda r: tf.matmul(r, pairs),
            doubled,
            lambda r: r @ pairs,
        ),
        # both rows: no broadcasting, pfor's own product
        "row @ row": (lambda r: tf.matmul(r, r), rows, lambda r: r @ r),
    }


@pytest.mark.parametrize("name", list(_products()))
def test_each_branch_of_the_rule_multiplies_as_numpy(name):
    """float32 sums of 16 products against NumPy's float64: measured 1e-6
    relative at most; bound 1e-5."""
    fn, rows, expected = _products()[name]
    # the rows an argument, not a constant the graph optimizer would fold
    found = tf.function(lambda r: vectorize.vectorized_map(fn, r))(tf.constant(rows))
    want = np.stack([expected(r.astype(np.float64)) for r in rows])
    assert found.shape == want.shape
    error = np.abs(found.numpy() - want).max() / np.abs(want).max()
    assert error < 1e-5, error


def test_the_rule_is_replaced_only_while_converting():
    """pfor's own rule is back after the block, nested blocks included."""
    registry = getattr(pfor, "_pfor_converter_registry", {})
    own = registry.get("BatchMatMulV2")
    if own is None:
        pytest.skip("this TensorFlow keeps pfor's rules elsewhere")
    with vectorize.safe_rules():
        assert registry["BatchMatMulV2"] is not own
        with vectorize.safe_rules():
            pass
        assert registry["BatchMatMulV2"] is not own
    assert registry["BatchMatMulV2"] is own


def test_every_vectorized_pass_in_the_package_goes_through_vectorize():
    """No module but :mod:`jacobkit.strategies.vectorize` calls pfor itself
    (``tf.vectorized_map``, or ``tape.jacobian``/``batch_jacobian`` with
    pfor, their default): a new strategy that did would miss the replaced
    rule."""
    import ast
    from pathlib import Path

    import jacobkit

    #: what may call these names: vectorize itself, and jacobkit's own API
    allowed = {"vectorize", "jk", "api"}
    root = Path(jacobkit.__file__).parent
    found = []
    for path in sorted(root.rglob("*.py")):
        if path.name == "vectorize.py" and path.parent.name == "strategies":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call) or not isinstance(
                node.func, ast.Attribute
            ):
                continue
            owner = node.func.value
            if isinstance(owner, ast.Name) and owner.id in allowed:
                continue
            pfor_off = any(
                k.arg == "experimental_use_pfor"
                and isinstance(k.value, ast.Constant)
                and k.value.value is False
                for k in node.keywords
            )
            name = node.func.attr
            if name == "vectorized_map" or (
                name in ("jacobian", "batch_jacobian") and not pfor_off
            ):
                found.append(f"{path.relative_to(root)}:{node.lineno}")
    assert not found, found
