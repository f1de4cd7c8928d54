"""What the peers' scripts share beyond their footing (``footing.py``) and
timing (``protocol.py``): reading the exported weights, the per-row loops
every framework's Jacobian is written with, CountSketch maps applied as
jacobkit applies them, and the loop of checked, timed methods with its JSON
lines.

Runs in the peers' environment (``python benchmarks/peers/x.py``: imported
by name from the scripts' own folder, as ``footing`` and ``protocol`` are)
and imports neither TensorFlow nor jacobkit; PyTorch and JAX are imported by
the functions that use them, so a JAX-only or a TensorFlow-side process
loads neither.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from importlib import metadata
from typing import Any

import numpy as np
from protocol import measure, paired

#: a method: its call (what is timed) and the check of the call's result:
#: its ``*_err`` values are errors held to the tolerance, anything else is
#: reported beside them
Run = tuple[Callable[[], Any], Callable[[Any], dict[str, float]]]


def load(path: str) -> dict[str, np.ndarray]:
    """An exported ``.npz`` as a dict of arrays, read into memory."""
    return dict(np.load(path))


def emit(row: dict[str, Any]) -> None:
    """One result as the JSON line the drivers read back (the last line of
    stdout that starts with ``{``)."""
    print(json.dumps(row), flush=True)


def version(package: str) -> str | None:
    """``package``'s installed version, or ``None``."""
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


# --------------------------------------------------------------------------
# PyTorch


def linear(kernel: np.ndarray, bias: np.ndarray) -> Any:
    """A ``torch.nn.Linear`` holding a Keras Dense layer's weights: the
    kernel ``(in, out)`` becomes the weight ``(out, in)``."""
    import torch

    layer = torch.nn.Linear(*kernel.shape)
    with torch.no_grad():
        layer.weight.copy_(torch.from_numpy(kernel).T)
        layer.bias.copy_(torch.from_numpy(bias))
    return layer


def conv(kernel: np.ndarray, bias: np.ndarray, **options: Any) -> Any:
    """A ``torch.nn.Conv1d`` or ``Conv2d`` holding a Keras convolution's
    weights: the kernel ``(*window, in, out)`` becomes the weight ``(out,
    in, *window)``; ``options`` (``stride``, ``padding``) as PyTorch's."""
    import torch

    weight = torch.from_numpy(kernel)
    spatial = weight.ndim - 2
    kind = {1: torch.nn.Conv1d, 2: torch.nn.Conv2d}[spatial]
    *window, fan_in, fan_out = weight.shape
    layer = kind(fan_in, fan_out, tuple(window), **options)
    with torch.no_grad():
        layer.weight.copy_(weight.permute(spatial + 1, spatial, *range(spatial)))
        layer.bias.copy_(torch.from_numpy(bias))
    return layer


def keras_rows(rows: Any) -> Any:
    """Per-example (or per-row) gradients ``(B, *parameter)`` of a PyTorch
    ``Linear`` or ``Conv1d``/``Conv2d`` weight in the Keras layout of the
    kernel it stands for (``(B, out, in)`` -> ``(B, in, out)``, ``(B, out,
    in, *window)`` -> ``(B, *window, in, out)``); a bias as it is."""
    if rows.ndim < 3:
        return rows
    return rows.permute(0, *range(3, rows.ndim), 2, 1)


def row_by_row(rows: Any, params: Sequence[Any]) -> list[Any]:
    """The gradient of every one of ``rows`` (a 1-D tensor on one graph)
    with respect to ``params``, one ``torch.autograd.grad`` per row:
    ``[(len(rows), *p.shape) for p in params]``."""
    import torch

    found = [torch.empty((rows.shape[0], *p.shape)) for p in params]
    for k in range(rows.shape[0]):
        grads = torch.autograd.grad(rows[k], list(params), retain_graph=True)
        for into, g in zip(found, grads):
            into[k] = g
    return found


def count_sketch(rows: Any, buckets: Any, signs: Any, dim: int) -> Any:
    """A CountSketch of ``rows`` ``(R, n)`` (each flattened as jacobkit
    flattens the variable it stands for: its Keras layout): ``(R, dim)``,
    coordinate ``i`` times ``signs[i]`` added to bucket ``buckets[i]``, one
    add per coordinate (``index_add_``), as ``jacobkit.problem.sketch``'s
    segment sum; not the ``(n, dim)`` matrix it stands for."""
    out = rows.new_zeros(rows.shape[0], dim)
    return out.index_add_(1, buckets.long(), rows * signs)


def count_sketch_matrix(buckets: Any, signs: Any, dim: int) -> Any:
    """The ``(n, dim)`` matrix a CountSketch stands for (row ``i``:
    ``signs[i]`` in column ``buckets[i]``), for a dense matmul ``rows @ M``
    that gives :func:`count_sketch`'s numbers (summed in another order)."""
    import torch

    matrix = torch.zeros(len(buckets), dim, dtype=signs.dtype)
    matrix[torch.arange(len(buckets)), buckets.long()] = signs
    return matrix


# --------------------------------------------------------------------------
# JAX


def jax_arrays(path: str) -> dict[str, Any]:
    """An exported ``.npz`` as JAX arrays."""
    import jax.numpy as jnp

    return {k: jnp.asarray(v) for k, v in np.load(path).items()}


def jax_rows(
    features: Callable[..., Any], method: str = "lax_map", batch_size: int = 1
) -> Callable[..., Any]:
    """A compiled call ``(*params) -> per-row gradients`` of the 1-D
    ``features(*params)``, every row's from one ``jax.vjp``: ``jax.lax.map``
    over chunks of ``batch_size`` rows (``"lax_map"``), or ``jax.vmap`` of
    the ``vjp`` over chunks unrolled in the compiled function (``"vmap"``);
    the call waits for its result."""
    import jax
    import jax.numpy as jnp

    @jax.jit
    def jacobian(*params: Any) -> Any:
        rows, vjp = jax.vjp(features, *params)
        eye = jnp.eye(rows.shape[0], dtype=rows.dtype)
        if method == "lax_map":
            return jax.lax.map(vjp, eye, batch_size=batch_size)
        chunks = [
            jax.vmap(vjp)(eye[i : i + batch_size])
            for i in range(0, rows.shape[0], batch_size)
        ]
        return tuple(jnp.concatenate(parts) for parts in zip(*chunks))

    def call(*params: Any) -> Any:
        out = jacobian(*params)
        jax.block_until_ready(out)
        return out

    return call


# --------------------------------------------------------------------------
# the checked methods of reductions_torch.py, influence_torch.py, tokens_torch.py


def method_parser(
    doc: str, npz: str, methods: Sequence[str]
) -> argparse.ArgumentParser:
    """The options every checked-methods script takes: ``--npz``,
    ``--method`` (repeatable), ``--repeats``, ``--threads``, ``--tolerance``
    and ``--paired-rounds``."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--npz", default=npz)
    parser.add_argument("--method", choices=methods, action="append")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--tolerance", type=float, default=1e-4)
    parser.add_argument(
        "--paired-rounds",
        type=int,
        default=10,
        help="rounds of each method against its own plain step in this "
        "process (protocol.paired); 0: none",
    )
    return parser


def started(
    script: str,
    args: argparse.Namespace,
    methods: Sequence[str],
    needs: Callable[[str], str | None] = lambda method: None,
) -> tuple[dict[str, Any], list[str]]:
    """A checked-methods script's start: PyTorch pinned to ``args.threads``
    (its footing record, ``footing.pin_torch``'s), and the methods to run:
    those asked (``args.method``), else every one of ``methods`` whose
    package (``needs(method)``, beyond torch; or ``None``) is installed,
    those left out named on stderr. A method asked for whose package is
    missing ends the run."""
    import footing

    record = footing.pin_torch(script, args.threads)
    asked = args.method
    missing = {m: p for m in methods if (p := needs(m)) and version(p) is None}
    if asked:
        refused = [f"{m} needs {missing[m]}" for m in asked if m in missing]
        if refused:
            raise SystemExit(f"{script}: {'; '.join(refused)}")
        return record, list(asked)
    if missing:
        print(f"{script}: not installed, skipped {list(missing)}", file=sys.stderr)
    return record, [m for m in methods if m not in missing]


def run_methods(
    script: str,
    runs: Any,
    methods: Sequence[str],
    args: argparse.Namespace,
    record: dict[str, Any],
    facts: Callable[[str, dict[str, Any], Any], dict[str, Any]],
    *,
    baseline: Callable[[str], str] = lambda method: "plain_step",
    kept: Callable[[str, Any], Any] = lambda method, result: None,
    after_first: Callable[[], None] | None = None,
) -> None:
    """Each of ``methods`` in turn, ``runs.<method>()`` giving its
    :data:`Run`: timed (``protocol.measure``, ``args.repeats`` steady
    calls), its last result checked (the errors to stderr), then, if every
    ``*_err`` is within ``args.tolerance``, paired with its own plain step
    ``runs.<baseline(method)>()`` in this process (``args.paired_rounds``
    rounds; none for the plain step itself) and printed as one JSON line:
    the peer (``torch``) and method, ``facts(method, timings, kept(method,
    result))`` (the script's own fields; ``kept``: what they need of the
    result, taken before the result is freed), the checks, the timings and
    the footing ``record`` (``footing.pin_torch``'s).
    ``after_first`` runs once, after the first method's timing. A method that
    raises or disagrees prints no line; the run ends with a ``SystemExit``
    naming them after the others ran."""
    failed = []

    def refused(method: str, error: Exception) -> None:
        print(f"{script}: {method} failed: {error!r}", file=sys.stderr)
        reason = " ".join(f"{type(error).__name__}: {error}".split())
        failed.append(f"{method} not supported ({reason[:300]})")

    for method in methods:
        try:  # a mode the peer refuses (Opacus on a layer it has no rule for)
            call, check = getattr(runs, method)()
            timings, result = measure(call, args.repeats)
        except Exception as error:  # noqa: BLE001 - a method that fails is reported
            refused(method, error)
            continue
        if after_first is not None:  # a check of the whole run: it may end it
            after_first, hook = None, after_first
            hook()
        try:
            checks = check(result)
            facts_of_result = kept(method, result)
        except Exception as error:  # noqa: BLE001
            refused(method, error)
            continue
        del result
        print(
            f"{script}: {method}: "
            + (", ".join(f"{k} {v:.2e}" for k, v in checks.items()) or "no check"),
            file=sys.stderr,
        )
        wrong = {
            k: v
            for k, v in checks.items()
            if k.endswith("_err") and not v <= args.tolerance
        }
        if wrong:
            shown = ", ".join(f"{k} {v:.1e}" for k, v in wrong.items())
            failed.append(f"{method} disagrees with jacobkit ({shown})")
            continue
        base_method = baseline(method)
        if args.paired_rounds and method != base_method:
            # against the same framework's plain step, alternating in this process
            base, _ = getattr(runs, base_method)()
            timings["paired"] = paired(call, base, args.paired_rounds)
        emit(
            {
                "peer": "torch",
                "method": method,
                **facts(method, timings, facts_of_result),
                **checks,
                **timings,
                "footing": record,
            }
        )
    if failed:  # one line: the runner keeps the last line of stderr
        raise SystemExit(
            f"{script}: {'; '.join(failed)} (checked against jacobkit's results "
            f"in {args.npz}, tolerance {args.tolerance:g})"
        )
