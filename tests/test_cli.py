"""``jacobkit compare``: the built-in problem and a user's saved model."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import keras
import numpy as np
import pytest
import tf_keras

from jacobkit import cli, strategies
from jacobkit.testing import examples

ROOT = pathlib.Path(__file__).parent.parent

SMALL = ["--batch", "2", "--sequence", "8", "--channels", "3", "--filters", "4"]


def _table_rows(text: str) -> dict[str, list[str]]:
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and cells[0] not in ("strategy",):
            rows[cells[0]] = cells
    return rows


def _assert_all_agree(text: str) -> None:
    """Every registered strategy ran and agrees, but those the footer says
    were skipped as hopeless."""
    rows = _table_rows(text)
    names = {label.split("(")[0] for label in rows}
    footer = [line for line in text.splitlines() if line.startswith("skipped")]
    skipped = {n for n in strategies.REGISTRY if footer and f" {n}: " in footer[0]}
    assert set(strategies.REGISTRY) - skipped <= names, text
    assert not skipped & names, text
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


def test_compare_skips_forward_where_it_is_hopeless_and_says_why(capsys):
    """conv1's 5x3x4 kernel and 4 biases are 64 parameters for 6 rows: a
    forward pass per chunk of parameters against a backward pass per row
    (a DenseNet head's forward took 55 of 128 s at 0.1x the loop). Named, it
    runs."""
    args = ["compare", *SMALL, "--num-features", "6", "--repeats", "1"]
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert not any(label.startswith("forward") for label in _table_rows(out)), out
    assert out.splitlines()[-1] == (
        "skipped (predicted hopeless here): forward: 64 parameters > 6 rows (a "
        "forward pass per chunk of parameters, the loop a backward pass per "
        "row). To run it anyway, name it: --strategies forward,loop"
    ), out
    assert cli.main([*args, "--strategies", "forward,loop"]) == 0
    out = capsys.readouterr().out
    assert {label.split("(")[0] for label in _table_rows(out)} == {"forward", "loop"}
    assert "skipped" not in out


def test_forward_is_in_the_default_set_where_it_is_not_hopeless():
    from jacobkit.bench import candidates
    from jacobkit.problem import Call

    def default_names(**sizes):
        ex = examples.build("generator", batch=2, sequence=8, **sizes)
        problem = Call(ex.model, ex.layer).problem(ex.inputs)
        chosen, skipped = candidates.default_strategies(problem)
        return {s.name for s in chosen}, {s.strategy.name: s.reason for s in skipped}

    # 5x3x4 + 4 = 64 parameters: 144 rows, 61 forward passes (one per kernel
    # element) against the loop's 432 (a backward pass is ~3 forward passes)
    chosen, skipped = default_names(channels=3, filters=4, features=144)
    assert "forward" in chosen and skipped == {}
    # 64 parameters for 6 rows
    chosen, skipped = default_names(channels=3, filters=4, features=6)
    assert "forward" not in chosen
    assert skipped["forward"].startswith("64 parameters > 6 rows")


def test_compare_auto_under_a_budget(capsys):
    args = ["compare", *SMALL, "--num-features", "6", "--repeats", "1"]
    code = cli.main([*args, "--strategies", "auto,while", "--memory-budget", "1GiB"])
    out = capsys.readouterr().out
    assert code == 0, out
    rows = _table_rows(out)
    assert len(rows) == 2 and "while" in rows, out
    (auto,) = [cells for label, cells in rows.items() if label.startswith("auto: ")]
    assert float(auto[-1]) < 1e-4, out


def test_compare_children_use_the_plan_cache_of_the_call(tmp_path, monkeypatch):
    """The children are forked from one server, which keeps the environment
    it started with: the auto row wrote into the first call's plan cache
    ever after (under pytest, an earlier test's)."""
    args = ["compare", *SMALL, "--num-features", "6", "--repeats", "1"]
    for name in ("first", "second"):
        monkeypatch.setenv("JACOBKIT_CACHE_DIR", str(tmp_path / name))
        assert cli.main([*args, "--strategies", "auto"]) == 0
    for name in ("first", "second"):
        assert len(list((tmp_path / name).glob("*.json"))) == 1, name


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


# -- user mistakes: one line on stderr, exit code 2 ------------------------------
def _small_saved_model(tmp_path, flavour=keras, suffix=".keras"):
    """A saved Dense model ("d" -> "head") and its inputs: (model path, x path)."""
    layers = flavour.layers
    model = flavour.Sequential(
        [
            flavour.Input((5,)),
            layers.Dense(3, activation="tanh", name="d"),
            layers.Dense(2, name="head"),
        ]
    )
    model_path = tmp_path / f"small{suffix}"
    inputs_path = tmp_path / "x.npy"
    model.save(model_path)
    np.save(inputs_path, np.random.default_rng(0).normal(size=(3, 5)).astype("f4"))
    return str(model_path), str(inputs_path)


def _mistakes(model, x, tmp_path):
    missing = str(tmp_path / "missing.keras")
    return {
        "layer-without-model": (
            ["compare", "--layer", "head"],
            "jacobkit compare: error: --layer needs --model (a saved Keras model); "
            "without --model the built-in generator runs.",
        ),
        "inputs-and-layer-without-model": (
            ["compare", "--inputs", x, "--layer", "head"],
            "jacobkit compare: error: --inputs and --layer need --model (a saved "
            "Keras model); without --model the built-in generator runs.",
        ),
        "model-without-inputs": (
            ["compare", "--model", model],
            "jacobkit compare: error: --model needs --inputs X.npy and --layer NAME",
        ),
        "missing-model": (
            ["compare", "--model", missing, "--inputs", x, "--layer", "head"],
            f"jacobkit compare: error: --model {missing}: no such file.",
        ),
        "missing-inputs": (
            ["compare", "--model", model, "--inputs", missing, "--layer", "head"],
            f"jacobkit compare: error: --inputs {missing}: no such file.",
        ),
        "size-with-model": (
            [
                "compare",
                "--model",
                model,
                "--inputs",
                x,
                "--layer",
                "head",
                "--batch",
                "4",
            ],
            "jacobkit compare: error: --batch size the built-in problem; with "
            "--model the model and --inputs give the sizes. Drop them.",
        ),
        "layer-typo": (
            ["compare", "--model", model, "--inputs", x, "--layer", "Head"],
            "jacobkit compare: error: jacobian(layer='Head'): the model has no "
            "layer named 'Head'. Did you mean 'head'?",
        ),
        "unknown-strategy": (
            ["compare", "--strategies", "loop,fastest"],
            "jacobkit compare: error: jacobian(strategy='fastest'): unknown "
            "strategy. Choose one of "
            f"{', '.join(repr(n) for n in strategies.names())}, or pass a "
            "configured instance such as jacobkit.strategies.Chunked(chunk_size=16).",
        ),
        "bad-option": (
            ["compare", "--repeats", "many"],
            "jacobkit compare: error: argument --repeats: invalid int value: 'many' "
            "(see jacobkit compare --help)",
        ),
        "negative-time-limit": (
            ["compare", "--time-limit", "-1"],
            "jacobkit compare: error: argument --time-limit: -1 is negative: give "
            "the seconds each strategy may run (0 or 'none': no limit) (see "
            "jacobkit compare --help)",
        ),
        "time-limit-not-seconds": (
            ["compare", "--time-limit", "soon"],
            "jacobkit compare: error: argument --time-limit: 'soon' is not a "
            "number of seconds (0 or 'none': no limit) (see jacobkit compare "
            "--help)",
        ),
        "run-layer-without-model": (
            ["run", "--layer", "head"],
            "jacobkit run: error: --layer needs --model (a saved Keras model); "
            "without --model the built-in generator runs.",
        ),
        "run-missing-inputs": (
            ["run", "--model", model, "--inputs", missing, "--layer", "head"],
            f"jacobkit run: error: --inputs {missing}: no such file or directory.",
        ),
        "run-layer-typo": (
            ["run", "--model", model, "--inputs", x, "--layer", "Head"],
            "jacobkit run: error: jacobian(layer='Head'): the model has no "
            "layer named 'Head'. Did you mean 'head'?",
        ),
    }


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return _small_saved_model(tmp_path_factory.mktemp("saved"))


@pytest.mark.parametrize(
    "mistake",
    [
        "layer-without-model",
        "inputs-and-layer-without-model",
        "model-without-inputs",
        "missing-model",
        "missing-inputs",
        "size-with-model",
        "layer-typo",
        "unknown-strategy",
        "bad-option",
        "negative-time-limit",
        "time-limit-not-seconds",
        "run-layer-without-model",
        "run-missing-inputs",
        "run-layer-typo",
    ],
)
def test_user_mistakes_give_one_line_and_exit_code_2(saved, tmp_path, capsys, mistake):
    argv, message = _mistakes(*saved, tmp_path)[mistake]
    try:
        code = cli.main(argv)
    except SystemExit as exit:  # argparse's own errors
        code = exit.code
    captured = capsys.readouterr()
    assert code == 2
    assert captured.err == message + "\n"
    assert captured.out == ""


# -- saved models of either Keras --------------------------------------------------
@pytest.mark.parametrize("suffix", [".keras", ".h5"])
@pytest.mark.parametrize("flavour", [keras, tf_keras], ids=["keras3", "tf_keras"])
def test_compare_loads_either_keras(tmp_path, capsys, flavour, suffix):
    model, x = _small_saved_model(tmp_path, flavour, suffix)
    argv = ["compare", "--model", model, "--inputs", x, "--layer", "d"]
    code = cli.main([*argv, "--strategies", "loop,chunked", "--repeats", "1"])
    out = capsys.readouterr().out
    assert code == 0, out
    rows = _table_rows(out)
    assert set(rows) == {"loop", "chunked(16)"}, out
    for cells in rows.values():
        assert float(cells[-1]) < 1e-4, out


# -- start-up: no TensorFlow for --help, no TensorFlow logs unless -v ---------------
def _run(code: str, env: dict | None = None) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={**clean, **(env or {})},
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_help_does_not_import_tensorflow():
    done = _run(
        "import sys\n"
        "from jacobkit import cli\n"
        "try:\n"
        "    cli.main(['--help'])\n"
        "except SystemExit as exit:\n"
        "    assert exit.code == 0\n"
        "print('tensorflow' in sys.modules, 'keras' in sys.modules)\n"
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "False False", done.stdout
    assert "compare" in done.stdout and done.stderr == ""


def test_tensorflow_logs_stay_hidden_unless_verbose(saved):
    model, x = saved
    argv = ["compare", "--model", model, "--inputs", x, "--layer", "hed"]
    code = "import sys; from jacobkit import cli; sys.exit(cli.main(sys.argv[1:]))"
    quiet = _run(code.replace("sys.argv[1:]", repr(argv)))
    assert quiet.returncode == 2
    # TensorFlow loaded (the layer name is checked on the model): one line
    assert quiet.stderr.splitlines() == [
        "jacobkit compare: error: jacobian(layer='hed'): the model has no layer "
        "named 'hed'. Did you mean 'head'?"
    ], quiet.stderr
    verbose = _run(code.replace("sys.argv[1:]", repr(["-v", *argv])))
    assert verbose.returncode == 2
    # TensorFlow 2.21 logs while its libraries load (absl's "All log messages
    # before absl::InitializeLog() is called are written to STDERR", oneDNN)
    assert len(verbose.stderr.splitlines()) > 1, verbose.stderr
    assert verbose.stderr.splitlines()[-1] == quiet.stderr.splitlines()[-1]


def test_run_prints_no_tensorflow_logs_and_names_its_flags(tmp_path):
    # the built-in job into --out, then the same directory with other inputs:
    # the refusal says what to type (--overwrite), not the keyword argument
    out = str(tmp_path / "out")
    code = "import sys; from jacobkit import cli; sys.exit(cli.main(sys.argv[1:]))"

    def run(*argv):
        return _run(code.replace("sys.argv[1:]", repr(["run", *argv])))

    first = run("--examples", "8", "--batch-size", "8", "--out", out, "--no-progress")
    assert first.returncode == 0, first.stderr
    assert first.stderr == "", first.stderr
    assert "computed 144 rows" in first.stdout
    other = run("--examples", "8", "--batch-size", "4", "--out", out, "--no-progress")
    assert other.returncode == 2
    (line,) = other.stderr.splitlines()
    assert line.startswith("jacobkit run: error: ")
    assert "--overwrite" in line and "overwrite=True" not in line, line


def test_run_hides_tensorflow_logs_unless_verbose(saved):
    """``jacobkit run`` starts TensorFlow quietly, as ``compare`` does: with a
    user's mistake, stderr holds jacobkit's one line and nothing else."""
    model, x = saved
    argv = ["run", "--model", model, "--inputs", x, "--layer", "hed"]
    code = "import sys; from jacobkit import cli; sys.exit(cli.main(sys.argv[1:]))"
    quiet = _run(code.replace("sys.argv[1:]", repr(argv)))
    assert quiet.returncode == 2
    assert len(quiet.stderr.splitlines()) == 1, quiet.stderr
    assert quiet.stderr.startswith("jacobkit run: error: "), quiet.stderr
    assert "'hed'" in quiet.stderr, quiet.stderr
    verbose = _run(code.replace("sys.argv[1:]", repr(["-v", *argv])))
    assert verbose.returncode == 2
    assert len(verbose.stderr.splitlines()) > 1, verbose.stderr


#: the built-in generator at the size of the user's report: ``conv1``'s kernel
#: has 409,600 elements, one forward pass each (minutes), but 2 rows (the
#: reference and the reverse-mode strategies take a few backward passes)
WIDE = [*("--batch", "2", "--sequence", "8", "--channels", "320"), "--filters", "256"]


def _with_unrefused_forward(monkeypatch) -> None:
    """The strategies compare runs by default: loop, forward told to run
    whatever its cost (not by name on the command line), while."""
    from jacobkit.bench import candidates as defaults

    def candidates(problem):
        forward = strategies.Forward(max_slowdown=None)
        return [strategies.Loop(), forward, strategies.While()], []

    monkeypatch.setattr(defaults, "default_strategies", candidates)


def test_a_strategy_past_the_time_limit_is_stopped_and_the_table_prints(
    capsys, monkeypatch
):
    """forward on a 409,600-element kernel (the user's report: minutes with
    no word) is stopped at the time limit; its row says so, and the rows
    before and after it are measured and printed."""
    _with_unrefused_forward(monkeypatch)
    argv = ["compare", *WIDE, "--num-features", "2", "--repeats", "1"]
    code = cli.main([*argv, "--time-limit", "15"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "each strategy in a fresh process (15 s)" in out
    rows = _table_rows(out)
    (auto,) = [label for label in rows if label.startswith("auto")]
    forward = strategies.Forward(max_slowdown=None).label
    assert set(rows) == {"loop", forward, "while", auto}, out
    assert rows[forward][1] == "failed: TimeLimit: no result within 15 s", out
    for label in ("loop", "while", auto):
        assert float(rows[label][-1]) < 1e-4, out


def test_interrupted_compare_prints_the_rows_measured_so_far(capsys, monkeypatch):
    """Ctrl-C during a strategy (forward on a large kernel was one that ran
    for minutes) stops its process and prints the table of the strategies
    already measured."""
    import multiprocessing
    import signal
    import threading

    from jacobkit.bench import processes

    _with_unrefused_forward(monkeypatch)
    real = processes.ChildPool.run
    main = threading.main_thread().ident
    assert main is not None

    def interrupted_in_forward(pool, task, timeout_s):
        if task["strategy"] != "forward":
            return real(pool, task, timeout_s)
        # Ctrl-C once forward's process runs: SIGINT to the waiting thread
        ctrl_c = threading.Timer(2.0, signal.pthread_kill, (main, signal.SIGINT))
        ctrl_c.start()
        try:
            return real(pool, task, timeout_s)
        finally:
            ctrl_c.cancel()

    monkeypatch.setattr(processes.ChildPool, "run", interrupted_in_forward)
    argv = ["compare", *WIDE, "--num-features", "2", "--repeats", "1"]
    # a test worker process (pytest -n) ignores SIGINT, which its controller
    # handles: Python's own handler, as a user's terminal has, for this test
    handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        code = cli.main([*argv, "--time-limit", "300"])
    finally:
        signal.signal(signal.SIGINT, handler)
    out = capsys.readouterr().out
    assert code == 130, out
    rows = _table_rows(out)
    assert set(rows) == {"loop"}, out
    assert float(rows["loop"][-1]) < 1e-4, out
    assert out.splitlines()[-1] == "interrupted: 1 of 4 strategies measured", out
    assert multiprocessing.active_children() == []  # forward's process is gone


@pytest.mark.parametrize(
    "text, seconds",
    [("2.5", 2.5), ("120", 120.0), ("0", None), ("none", None), ("inf", None)],
)
def test_time_limit_values(text, seconds):
    from jacobkit.cli import compare

    assert compare._time_limit(text) == seconds


# -- a saved model with a custom layer -----------------------------------------------
CUSTOM_LAYER = '''
import keras


class Scale(keras.layers.Layer):
    """A learned scale per feature: not a Keras layer, not registered."""

    def build(self, input_shape):
        self.scale = self.add_weight(shape=input_shape[-1:], initializer="ones")

    def call(self, x):
        return x * self.scale
'''


def _custom_model(tmp_path, monkeypatch):
    """A model with a custom layer saved next to the module that defines it
    (the user's directory, the current one); (model path, inputs path)."""
    (tmp_path / "my_layers.py").write_text(CUSTOM_LAYER)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    import my_layers

    model = keras.Sequential(
        [
            keras.Input((5,)),
            keras.layers.Dense(4, activation="tanh", name="d"),
            my_layers.Scale(name="scale"),
            keras.layers.Dense(3, name="head"),
        ]
    )
    x = np.random.default_rng(0).normal(size=(4, 5)).astype("float32")
    model.save(tmp_path / "custom.keras")
    np.save(tmp_path / "x.npy", x)
    # the command runs in a new process: the module is not imported there yet
    monkeypatch.delitem(sys.modules, "my_layers")
    return "custom.keras", "x.npy"


def test_a_model_with_a_custom_layer_loads_by_naming_its_module(
    tmp_path, monkeypatch, capsys
):
    model, x = _custom_model(tmp_path, monkeypatch)
    common = ["--model", model, "--inputs", x, "--layer", "d"]
    # without the module, Keras cannot rebuild the layer: the error says how
    assert cli.main(["compare", *common]) == cli.USAGE_ERROR
    error = capsys.readouterr().err
    assert error == (
        "jacobkit compare: error: --model custom.keras: the model holds the "
        "custom class 'Scale' (from module 'my_layers'), which keras cannot "
        "rebuild unless it is given: --custom-objects my_layers:Scale (run from "
        "the module's directory, or add it to PYTHONPATH).\n"
    )
    custom = ["--custom-objects", "my_layers:Scale"]
    # compare: loaded here and in each strategy's process
    args = ["compare", *common, *custom, "--strategies", "loop,chunked"]
    assert cli.main([*args, "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    rows = _table_rows(out)
    assert {label.split("(")[0] for label in rows} == {"loop", "chunked"}, out
    # the float64 copy is rebuilt with the custom class too
    assert "reference: float64 loop on a float64 copy of the model" in out, out
    assert all(float(cells[-1]) < 1e-4 for cells in rows.values()), out
    # run
    assert cli.main(["run", *common, *custom, "--strategy", "chunked"]) == 0
    assert "computed 3 rows" in capsys.readouterr().out


@pytest.mark.parametrize(
    "spec, message",
    [
        ("no_such_module:Scale", "cannot import 'no_such_module'"),
        ("my_layers:Scal", "module 'my_layers' has no 'Scal'"),
    ],
)
def test_custom_objects_that_cannot_be_found(
    tmp_path, monkeypatch, capsys, spec, message
):
    model, x = _custom_model(tmp_path, monkeypatch)
    args = ["compare", "--model", model, "--inputs", x, "--layer", "d"]
    assert cli.main([*args, "--custom-objects", spec]) == cli.USAGE_ERROR
    error = capsys.readouterr().err
    assert error.startswith(f"jacobkit compare: error: --custom-objects {spec}: ")
    assert message in error, error
