"""The equal-footing helpers of the PyTorch comparisons
(``benchmarks/peers``) that run in jacobkit's environment: BERT's export under
Hugging Face's names and layouts, and the one-core check every side runs.

The peers themselves need PyTorch and run in their own environment; these
are the parts whose mistakes would make both sides differentiate different
functions, or measure on different footing, without any check failing.
"""

from __future__ import annotations

import sys
from pathlib import Path

import keras
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "peers"))

import bert_layout  # noqa: E402
import footing  # noqa: E402


class _Loader:
    """keras_hub's safetensors loader, in part: the tensors of a dict, the
    ``bert.`` prefix dropped as keras_hub's own loader resolves it."""

    def __init__(self, tensors: dict[str, np.ndarray]) -> None:
        self.tensors = {k.removeprefix("bert."): v for k, v in tensors.items()}

    def get_tensor(self, key: str) -> np.ndarray:
        return self.tensors[key]

    def port_weight(self, keras_variable, hf_weight_key, hook_fn=None) -> None:
        tensor = self.get_tensor(hf_weight_key)
        if hook_fn:
            tensor = hook_fn(tensor, list(keras_variable.shape))
        keras_variable.assign(tensor)


def test_bert_export_is_inverted_by_keras_hubs_own_converter():
    """Every backbone variable, exported by ``bert_layout.hf`` and read back
    by keras_hub's ``convert_bert.convert_weights`` (Hugging Face -> Keras),
    is itself: the names and layouts the PyTorch peer loads are the ones
    keras_hub reads from Hugging Face checkpoints (exactly: a permutation)."""
    keras_hub = pytest.importorskip("keras_hub")
    from keras_hub.src.utils.transformers import convert_bert

    sizes = dict(
        vocabulary_size=50,
        num_layers=2,
        num_heads=2,
        hidden_dim=8,
        intermediate_dim=16,
        max_sequence_length=12,
    )
    keras.utils.set_random_seed(1)
    source = keras_hub.models.BertBackbone(**sizes)
    exported = dict(
        bert_layout.hf(v.path, np.asarray(v)) for v in source.trainable_variables
    )
    keras.utils.set_random_seed(2)
    target = keras_hub.models.BertBackbone(**sizes)
    convert_bert.convert_weights(target, _Loader(exported), {})
    for want, got in zip(source.trainable_variables, target.trainable_variables):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), want.path)


def test_bert_export_names_the_classifier_head_as_hugging_face_does():
    kernel = np.arange(12.0).reshape(3, 4)  # (hidden, classes)
    name, array = bert_layout.hf("logits/kernel", kernel)
    assert name == "classifier.weight"
    np.testing.assert_array_equal(array, kernel.T)
    with pytest.raises(SystemExit, match="no Hugging Face name"):
        bert_layout.hf("unknown/kernel", kernel)


def test_a_run_on_more_than_one_core_is_refused(monkeypatch):
    monkeypatch.setattr(footing.os, "sched_getaffinity", lambda pid: {0, 1})
    with pytest.raises(SystemExit, match="refusing to run on 2 cores"):
        footing.require_pinned("peer")
    monkeypatch.setattr(footing.os, "sched_getaffinity", lambda pid: {1})
    assert footing.require_pinned("peer") == 1


def test_the_record_names_the_cpu_and_every_version():
    record = {"side": "tensorflow", **footing.machine(), "versions": footing.versions()}
    assert set(footing.PACKAGES) <= set(record["versions"])
    assert record["versions"]["python"] == ".".join(map(str, sys.version_info[:3]))
    line = footing.describe({**record, "threads": 1, "interop_threads": 1})
    assert record["cpu"] in line and "oneDNN" in line
