"""A batch of 0 examples is refused in jacobkit's words, before the model is
called or anything traced: one batch, a dataset's batch, an iterable's.

Before, a layer target failed with TensorFlow's ``InvalidArgumentError`` from
the conv closed form ("Incompatible shapes: [0,8,4] vs. [6]"), with
kilobytes of TensorFlow C++ logs in a fresh process, and ``Inputs()`` with an
error about ``strategy='batch'``, which the user never chose.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import jacobkit as jk
from tests.cases import example

ONE = "jacobian\\(inputs=...\\): the batch holds 0 examples \\(an input of shape"


@pytest.mark.parametrize("target", ["layer", "inputs", "output"])
def test_one_empty_batch_is_refused(target):
    ex = example("generator")
    chosen = {"layer": ex.layer, "inputs": jk.Inputs(), "output": jk.Output("conv2")}
    empty = ex.inputs[:0]
    with pytest.raises(ValueError, match=ONE + r" \(0, 8, 4\)\)"):
        jk.jacobian(ex.model, empty, chosen[target])
    with pytest.raises(ValueError, match=ONE):
        jk.plan(ex.model, empty, chosen[target])
    with pytest.raises(ValueError, match=ONE):
        jk.verify([np.zeros(0)], ex.model, empty, chosen[target])


def test_nothing_is_called_before_the_refusal():
    calls = []

    def f(x):
        calls.append(x.shape)
        return tf.tanh(x)

    with pytest.raises(ValueError, match=ONE):
        jk.jacobian(f, np.zeros((0, 3), "float32"), jk.Inputs())
    with pytest.raises(ValueError, match=ONE):
        jk.jacobian(f, np.zeros((0, 3), "float32"), jk.Inputs(), strategy="loop")
    assert calls == []


def test_an_empty_input_of_several_is_refused():
    ex = example("multi_input")
    first, second = ex.inputs
    with pytest.raises(ValueError, match=ONE):
        jk.jacobian(ex.model, (first[:0], second[:0]), jk.Inputs())


def test_an_empty_batch_of_a_dataset_is_refused_by_its_index():
    ex = example("generator")
    dataset = tf.data.Dataset.from_tensor_slices(ex.inputs).batch(2)
    emptied = dataset.map(lambda x: x[:0])
    with pytest.raises(ValueError, match=r"batch 0 holds 0 examples .*drop empty"):
        jk.jacobian(ex.model, emptied, ex.layer)
    # a later batch: refused when it comes, by its index
    later = iter([ex.inputs, ex.inputs[:0]])
    with pytest.raises(ValueError, match=r"batch 1 holds 0 examples"):
        jk.jacobian(ex.model, later, jk.Inputs(), outputs="per_example")


def test_an_empty_batch_split_across_replicas_is_refused():
    ex = example("generator")
    spread = tf.distribute.OneDeviceStrategy("/cpu:0")
    with pytest.raises(ValueError, match=ONE):
        jk.jacobian(ex.model, ex.inputs[:0], ex.layer, distribute=spread)


def test_a_fresh_process_prints_the_refusal_not_tensorflows_logs():
    """Nothing is traced: no graph optimizer's cost warnings
    ("PredictCost() for the op ... Conv2DBackpropInput")."""
    code = (
        "import jacobkit as jk\n"
        "from jacobkit.testing import examples\n"
        "ex = examples.build('generator')\n"
        "jk.jacobian(ex.model, ex.inputs[:0], ex.layer)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env
    )
    assert done.returncode == 1
    assert "the batch holds 0 examples" in done.stderr.splitlines()[-1], done.stderr
    assert "PredictCost" not in done.stderr and "InvalidArgument" not in done.stderr
