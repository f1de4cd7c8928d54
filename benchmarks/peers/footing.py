"""Equal footing for every comparison of jacobkit with a peer framework: one
thread on each side, the process pinned to one core, and a record of the
machine and of every version that the results file keeps beside its numbers.

Imported by the peers (PyTorch) and by jacobkit's benchmark children
(TensorFlow) alike; it imports neither framework at module level.

- :func:`require_pinned` refuses to run a process that may use more than one
  core (its CPU affinity must be one core: ``taskset -c N``);
- :func:`pin_torch` / :func:`pin_tensorflow` set the framework's own thread
  pools to one thread (PyTorch's intra- and inter-op threads; TensorFlow's
  intra- and inter-op parallelism) before any work, and return what they set
  with the framework's CPU kernels (PyTorch's MKLDNN state, TensorFlow's
  oneDNN); :func:`one_jax_thread` (before JAX is imported) and
  :func:`pin_jax` do the same for XLA's CPU client;
- :func:`machine` is the CPU model and the instruction-set flags that decide
  the kernels (AVX2, AVX-512, AMX);
- :func:`versions` is every package version a table depends on.
"""

from __future__ import annotations

import os
import platform
import sys
from importlib import metadata
from typing import Any

#: the packages whose versions every record holds (those not installed in
#: the process's environment are recorded as ``None``)
PACKAGES = (
    "numpy",
    "tensorflow",
    "keras",
    "keras-hub",
    "torch",
    "opacus",
    "captum",
    "transformers",
    "traker",
)
#: the CPU flags that decide which kernels both frameworks run
FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")


def require_pinned(script: str) -> int:
    """The one core this process may run on; a ``SystemExit`` when its
    affinity allows more (an unpinned run measures a different machine on
    each side)."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) != 1:
        raise SystemExit(
            f"{script}: refusing to run on {len(cores)} cores {cores}: pin the "
            "process to one core (taskset -c N), as every run of these tables is"
        )
    return cores[0]


def machine() -> dict[str, Any]:
    """The CPU model and its kernel-deciding flags, from ``/proc/cpuinfo``."""
    model, flags = platform.processor() or "unknown", set()
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    model = value.strip()
                elif key.strip() == "flags":
                    flags = set(value.split())
                if model != "unknown" and flags:
                    break
    except OSError:
        pass
    return {
        "cpu": model,
        "flags": [f for f in FLAGS if f in flags],
        "logical_cpus": os.cpu_count(),
    }


def versions() -> dict[str, str | None]:
    """Python's and every package's version in this process's environment."""
    found: dict[str, str | None] = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


def pin_torch(script: str, threads: int = 1) -> dict[str, Any]:
    """One thread for PyTorch (intra- and inter-op), in a process pinned to
    one core; the record of this process's footing."""
    import torch

    core = require_pinned(script)
    torch.set_num_threads(threads)
    try:
        torch.set_num_interop_threads(threads)
    except RuntimeError:  # already set, or work already started
        if torch.get_num_interop_threads() != threads:
            raise
    return {
        "side": "torch",
        "core": core,
        "threads": torch.get_num_threads(),
        "interop_threads": torch.get_num_interop_threads(),
        "mkldnn": bool(torch.backends.mkldnn.is_available())
        and bool(torch.backends.mkldnn.enabled),
        **machine(),
        "versions": versions(),
    }


def pin_tensorflow(script: str, threads: int = 1) -> dict[str, Any]:
    """One thread for TensorFlow (intra- and inter-op parallelism), in a
    process pinned to one core, set before TensorFlow runs anything; the
    record of this process's footing."""
    import tensorflow as tf

    core = require_pinned(script)
    tf.config.threading.set_intra_op_parallelism_threads(threads)
    tf.config.threading.set_inter_op_parallelism_threads(threads)
    from jacobkit import runtime

    onednn = runtime.cpu_kind().onednn
    return {
        "side": "tensorflow",
        "core": core,
        "threads": tf.config.threading.get_intra_op_parallelism_threads(),
        "interop_threads": tf.config.threading.get_inter_op_parallelism_threads(),
        "onednn": onednn,
        **machine(),
        "versions": versions(),
    }


#: XLA's CPU client at one thread (read when JAX starts)
JAX_FLAGS = " --xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"


def one_jax_thread() -> None:
    """One thread for XLA's CPU client: call before JAX is imported."""
    if "jax" in sys.modules:
        raise RuntimeError("one_jax_thread: JAX is imported already")
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + JAX_FLAGS


def pin_jax(script: str, version: str) -> dict[str, Any]:
    """The record of a JAX process's footing (JAX ``version``), pinned to
    one core, XLA at one thread (:func:`one_jax_thread`, called before JAX
    started)."""
    core = require_pinned(script)
    if JAX_FLAGS not in os.environ.get("XLA_FLAGS", ""):
        raise SystemExit(f"{script}: call footing.one_jax_thread() before JAX starts")
    return {
        "side": "jax",
        "core": core,
        "threads": 1,
        **machine(),
        "versions": {**versions(), "jax": version},
    }


def describe(record: dict[str, Any] | None) -> str:
    """One line of a results file: a process's footing."""
    if not record:
        return "not recorded"
    kernels = (
        f"oneDNN {'on' if record.get('onednn') else 'off'}"
        if record.get("side") == "tensorflow"
        else f"MKLDNN {'on' if record.get('mkldnn') else 'off'}"
    )
    shown = ", ".join(f"{k} {v}" for k, v in record.get("versions", {}).items() if v)
    return (
        f"{record.get('side')}: {record.get('cpu')} "
        f"({', '.join(record.get('flags', [])) or 'no AVX2/AVX-512/AMX'}), "
        f"{record.get('threads')} intra-op / {record.get('interop_threads')} "
        f"inter-op thread(s) on one core, {kernels}; {shown}"
    )


if __name__ == "__main__":  # a quick look at this machine and environment
    print(describe({"side": sys.executable, **machine(), "versions": versions()}))


def machine_lines(data: dict[str, Any], measured: dict[str, Any]) -> list[str]:
    """A results file's lines on where it was measured: the machine, each
    side's footing (one line per framework) and, for a run labelled
    ``--loaded``, that its absolute times are not to be read alone."""
    lines = [f"Machine: {data.get('machine', 'not recorded')}.", ""]
    sides: dict[str, dict[str, Any]] = {}
    for row in measured.values():
        if row.get("footing"):
            sides.setdefault(row["footing"]["side"], row["footing"])
    lines += [f"- {describe(r)}" for _, r in sorted(sides.items())]
    lines.append("")
    if data.get("loaded"):
        lines += [
            "**Measured on a loaded machine** (2 cores shared with other "
            "work): absolute times are inflated and noisy; read the ratios to "
            "each framework's own plain step.",
            "",
        ]
    return lines
