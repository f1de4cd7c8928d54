"""The equal-footing helpers of the PyTorch comparisons
(``benchmarks/peers``) that run in jacobkit's environment: BERT's and GPT-2's
exports under Hugging Face's names and layouts, the one-core check every side
runs, and how the reductions page picks the PyTorch method it compares with.

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


#: a transformer small enough to check layouts in a second (BERT and GPT-2)
TINY = dict(
    vocabulary_size=50,
    num_layers=2,
    num_heads=2,
    hidden_dim=8,
    intermediate_dim=16,
    max_sequence_length=12,
)


def test_bert_export_is_inverted_by_keras_hubs_own_converter():
    """Every backbone variable, exported by ``bert_layout.hf`` and read back
    by keras_hub's ``convert_bert.convert_weights`` (Hugging Face -> Keras),
    is itself: the names and layouts the PyTorch peer loads are the ones
    keras_hub reads from Hugging Face checkpoints (exactly: a permutation)."""
    keras_hub = pytest.importorskip("keras_hub")
    from keras_hub.src.utils.transformers import convert_bert

    sizes = TINY
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


def _gpt2_backbone(seed: int):
    keras_hub = pytest.importorskip("keras_hub")
    keras.utils.set_random_seed(seed)
    return keras_hub.models.GPT2Backbone(**TINY)


def test_gpt2_views_take_each_variable_out_of_its_hugging_face_parameter():
    """``gpt2_layout.views`` (keras_hub's own converter run on index arrays)
    takes every backbone variable, exactly, out of ``export_gpt2``'s
    Hugging Face arrays (the weights the PyTorch peer loads): the query, key
    and value out of ``c_attn``'s thirds; and ``to_hf`` writes the
    variables back into exactly those arrays."""
    import export_gpt2
    import gpt2_layout

    backbone = _gpt2_backbone(3)
    weights = export_gpt2.hf_weights(backbone)
    shapes = {name: array.shape for name, array in weights.items()}
    views = gpt2_layout.views(backbone, shapes)
    variables = backbone.trainable_variables
    assert {v.path for v in variables} == set(views)
    for variable in variables:
        name, index = views[variable.path]
        assert index.shape == tuple(variable.shape)
        got = weights[name].reshape(-1)[index]
        np.testing.assert_array_equal(got, np.asarray(variable), variable.path)
    query = backbone.transformer_layers[1]._self_attention_layer.query_dense
    name, index = views[query.kernel.path]
    assert name == "transformer.h.1.attn.c_attn.weight"
    # the query is c_attn's first third of columns: (8, 24) -> [:, :8]
    np.testing.assert_array_equal(
        index.reshape(8, 8), np.arange(8 * 24).reshape(8, 24)[:, :8]
    )
    back = gpt2_layout.to_hf(views, shapes, {v.path: np.asarray(v) for v in variables})
    for name, array in weights.items():
        np.testing.assert_array_equal(back[name], array, name)


def test_gpt2_to_hf_refuses_a_parameter_not_written_whole():
    import export_gpt2
    import gpt2_layout

    backbone = _gpt2_backbone(4)
    shapes = {k: v.shape for k, v in export_gpt2.hf_weights(backbone).items()}
    views = gpt2_layout.views(backbone, shapes)
    arrays = {v.path: np.asarray(v) for v in backbone.trainable_variables}
    key = backbone.transformer_layers[0]._self_attention_layer.key_dense.kernel
    del arrays[key.path]
    with pytest.raises(SystemExit, match=r"c_attn\.weight"):
        gpt2_layout.to_hf(views, shapes, arrays)


def test_the_comparison_takes_the_fastest_peer_that_matched():
    """Issue 50's line: jacobkit's ratio to its own plain step against the
    fastest PyTorch method that matched jacobkit's result; a faster peer
    that failed (no timing, its reason instead) is not a candidate."""
    import importlib.util

    here = Path(__file__).resolve().parents[1] / "benchmarks"
    # appended, not first: benchmarks/ has modules named as installed ones
    # (coverage.py); reductions.py imports its sibling runs.py
    sys.path.append(str(here))
    spec = importlib.util.spec_from_file_location(
        "benchmarks_reductions", here / "reductions.py"
    )
    assert spec and spec.loader
    reductions = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(reductions)

    def timed(seconds: float, paired: float | None = None) -> dict:
        return {
            "steady_s": seconds,
            **({"paired": {"ratio": paired}} if paired else {}),
        }

    measured = {
        "m|plain step": timed(0.010),
        "m|clipped sum": timed(0.015, paired=1.4),
        "m|PyTorch plain step": timed(0.020),
        "m|Opacus hooks, clipped": timed(0.060),  # 3.0
        "m|PyTorch vmap(grad) clipped": timed(0.050, paired=2.8),
        "m|Opacus functorch, clipped": {
            "error": ["reductions_torch: clipped_opacus_functorch not supported (X)"]
        },
    }
    lines = reductions._versus_peers("m", measured)
    row = next(line for line in lines if line.startswith("| clipped sum"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells == [
        "clipped sum",
        "1.40",
        "PyTorch vmap(grad) clipped",
        "2.80",
        "0.50",
        "≤ 2.80: met",  # not a transformer: the goal is PyTorch's ratio
    ]
    bert = {k.replace("m|", "bert|"): v for k, v in measured.items()}
    row = next(
        line
        for line in reductions._versus_peers("bert", bert)
        if line.startswith("| clipped sum")
    )
    assert row.rstrip(" |").endswith("≤ 1.50: met")  # a transformer: 1.5
    assert reductions._failure(measured["m|Opacus functorch, clipped"]) == (
        "clipped_opacus_functorch not supported (X)"
    )
    # the peer's closing words (where its file was) stay off the page
    said = "reductions_torch: a disagrees with jacobkit (clipped_err 1e-1) (checked"
    assert reductions._failure(
        {"error": [said + " against jacobkit's results, x"]}
    ) == ("a disagrees with jacobkit (clipped_err 1e-1)")
    assert reductions._failure({"error": ["Traceback: boom"]}) == (
        "error: Traceback: boom"
    )


def test_the_shared_helpers_import_without_tensorflow_jacobkit_or_torch():
    """The peers' scripts run where neither TensorFlow nor jacobkit is
    installed, and the JAX ones need no PyTorch: importing their shared
    modules loads none of these."""
    import subprocess

    code = (
        "import sys; import common, footing, protocol; "
        "print(sorted(m for m in ('tensorflow', 'jacobkit', 'torch', 'jax', "
        "'keras') if m in sys.modules))"
    )
    found = subprocess.run(
        [sys.executable, "-c", code],
        cwd=Path(__file__).resolve().parents[1] / "benchmarks" / "peers",
        capture_output=True,
        text=True,
        check=True,
    )
    assert found.stdout.strip() == "[]"


def test_rounds_rotate_the_sides_and_time_each_call():
    import protocol

    calls: list[str] = []
    sides = {name: (lambda name=name: calls.append(name)) for name in "abc"}
    times = protocol.rotated(sides, 4, {"a": 1, "b": 2, "c": 1})
    assert calls == list("abbc" + "bbca" + "cabb" + "abbc")
    assert [len(r) for r in times["b"]] == [2, 2, 2, 2]
    assert all(t >= 0 for r in times["a"] for t in r)
    two: list[str] = []
    protocol.rotated({"x": lambda: two.append("x"), "y": lambda: two.append("y")}, 3, 1)
    assert two == list("xyyxxy")  # two sides alternate


def test_steady_calls_come_after_the_plan_settled():
    """``auto`` on the MLP without oneDNN settles at call 43-44 (its
    ``chunked(144)`` try after keeping ``while(10)``); waiting at most 40
    calls past the first 3 timed that try as steady calls. Here a call
    settles at call 50: every steady call (and the peak call) comes after."""
    import protocol

    settled_at = 50
    calls: list[bool] = []  # whether each call ran after settling

    def call() -> int:
        calls.append(len(calls) >= settled_at)
        return len(calls)

    timings, last = protocol.measure(call, 5, settled=lambda: len(calls) >= settled_at)
    assert last == settled_at + 6 == len(calls)
    assert calls[-6:] == [True] * 6 and not any(calls[:settled_at])
    assert timings["steady_s"] >= 0


def test_the_bootstrap_interval_holds_the_median_and_is_seeded():
    import protocol

    ratios = [1.0, 1.2, 0.9, 1.1, 1.05, 1.3, 0.95]
    low, high = protocol.bootstrap(ratios)
    assert min(ratios) <= low <= float(np.median(ratios)) <= high <= max(ratios)
    assert protocol.bootstrap(ratios) == (low, high)
    assert protocol.bootstrap([2.0] * 5) == (2.0, 2.0)


def test_jax_footing_needs_its_one_thread_set_before_jax(monkeypatch):
    monkeypatch.setattr(footing.os, "sched_getaffinity", lambda pid: {3})
    monkeypatch.setenv("XLA_FLAGS", "")
    with pytest.raises(SystemExit, match="one_jax_thread"):
        footing.pin_jax("peer", "0.0")
    monkeypatch.delitem(sys.modules, "jax", raising=False)
    footing.one_jax_thread()
    record = footing.pin_jax("peer", "0.0")
    assert record["core"] == 3 and record["versions"]["jax"] == "0.0"
    assert "intra_op_parallelism_threads=1" in footing.os.environ["XLA_FLAGS"]
    monkeypatch.setitem(sys.modules, "jax", object())
    with pytest.raises(RuntimeError, match="imported already"):
        footing.one_jax_thread()
