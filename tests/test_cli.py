"""``jacobkit compare``: the built-in problem and a user's saved model."""

from __future__ import annotations

import keras
import numpy as np
import pytest

from jacobkit import cli, examples, strategies

SMALL = ["--batch", "2", "--sequence", "8", "--channels", "3", "--filters", "4"]


def _table_rows(text: str) -> dict[str, list[str]]:
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and cells[0] not in ("strategy",):
            rows[cells[0]] = cells
    return rows


def _assert_all_agree(text: str) -> None:
    rows = _table_rows(text)
    names = {label.split("(")[0] for label in rows}
    assert set(strategies.REGISTRY) <= names, text
    for label, cells in rows.items():
        assert not cells[1].startswith("failed"), f"{label}: {cells}"
        assert float(cells[-1]) < 1e-4, f"{label} disagrees: {cells}"


def test_compare_builtin_problem(capsys):
    code = cli.main(["compare", *SMALL, "--num-features", "6", "--repeats", "1"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "built-in generator" in out and "reference: float64 loop" in out
    assert "rows (6,) (features)" in out
    _assert_all_agree(out)
    assert any(label.startswith("auto: ") for label in _table_rows(out)), out


def test_compare_auto_under_a_budget(capsys):
    args = ["compare", *SMALL, "--num-features", "6", "--repeats", "1"]
    code = cli.main([*args, "--strategies", "auto,while", "--memory-budget", "1GiB"])
    out = capsys.readouterr().out
    assert code == 0, out
    rows = _table_rows(out)
    assert len(rows) == 2 and "while" in rows, out
    (auto,) = [cells for label, cells in rows.items() if label.startswith("auto: ")]
    assert float(auto[-1]) < 1e-4, out


def test_compare_saved_model(tmp_path, capsys):
    # 8 features on 6 channels: every registered strategy applies
    # (structured finds the linear head)
    ex = examples.build("generator", features=8)
    model_path = tmp_path / "generator.keras"
    inputs_path = tmp_path / "x.npy"
    ex.model.save(model_path)
    np.save(inputs_path, ex.inputs)
    code = cli.main(
        [
            "compare",
            "--model",
            str(model_path),
            "--inputs",
            str(inputs_path),
            "--layer",
            "conv2",
            "--outputs",
            "per_example",
            "--repeats",
            "1",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert "generator.keras" in out and "rows (3, 8) (per_example)" in out
    assert "reference: float64 loop" in out
    _assert_all_agree(out)
    assert isinstance(keras.saving.load_model(model_path), keras.Model)


def test_compare_model_needs_inputs_and_layer(tmp_path):
    with pytest.raises(SystemExit, match="--model needs --inputs X.npy and --layer"):
        cli.main(["compare", "--model", str(tmp_path / "m.keras")])
