"""``jacobkit run``: a saved model over a directory of .npy inputs."""

from __future__ import annotations

import numpy as np

from jacobkit import cli, testing
from jacobkit.testing import examples


def test_run_saved_model_over_a_directory_into_out(tmp_path, capsys):
    ex = examples.build("generator", batch=10, features=4)
    ex64 = examples.build("generator", "float64", batch=10, features=4)
    model_path = tmp_path / "generator.keras"
    ex.model.save(model_path)
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    np.save(inputs / "a.npy", ex.inputs[:6])  # batches of 4 and 2
    np.save(inputs / "b.npy", ex.inputs[6:])  # one of 4
    out = tmp_path / "out"
    args = ["run", "--model", str(model_path), "--inputs", str(inputs)]
    args += ["--layer", "conv1", "--outputs", "per_example", "--batch-size", "4"]
    code = cli.main([*args, "--out", str(out), "--strategy", "chunked"])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "3 batches" in printed and "rows: (10, 4) (per_example)" in printed
    assert "computed 40 rows" in printed and f"result at: {out}" in printed
    layer = ex64.model.get_layer("conv1")
    reference = testing.reference_jacobian(
        ex64.model, ex64.inputs, [layer.kernel, layer.bias], outputs="per_example"
    )
    kernel = np.load(out / "00-conv1_kernel.npy")
    bias = np.load(out / "01-conv1_bias.npy")
    testing.assert_close([kernel, bias], reference)
    # the same command again: everything is done, nothing is computed
    assert cli.main([*args, "--out", str(out), "--strategy", "chunked"]) == 0
    assert "computed 0 rows" in capsys.readouterr().out


def test_run_errors_name_the_flags(tmp_path, capsys):
    """A refusal to mix two calls' results in one ``--out`` tells the user of
    the command line to pass ``--overwrite``, not ``overwrite=True``."""
    ex = examples.build("generator", batch=4, features=4)
    model_path = tmp_path / "generator.keras"
    ex.model.save(model_path)
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    np.save(inputs / "a.npy", ex.inputs)
    out = tmp_path / "out"
    args = ["run", "--model", str(model_path), "--inputs", str(inputs)]
    args += ["--out", str(out), "--strategy", "chunked", "--no-progress"]
    assert cli.main([*args, "--layer", "conv1"]) == 0
    capsys.readouterr()
    assert cli.main([*args, "--layer", "head"]) == cli.USAGE_ERROR
    error = capsys.readouterr().err
    assert "--overwrite" in error, error
    assert "overwrite=True" not in error, error
    assert "out=" not in error, error
    # and --overwrite does start afresh
    assert cli.main([*args, "--layer", "head", "--overwrite"]) == 0
