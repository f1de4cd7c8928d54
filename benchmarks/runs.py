"""How the benchmark scripts run each measurement: a fresh process pinned
to one core (``taskset -c 0`` where it exists; ``BENCH_CORE`` names
another), its last JSON line read back, and the median over rounds of the
runs that did not fail."""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys

FIELDS = ("first_s", "first_three_s", "steady_s", "first_growth_mib", "peak_growth_mib")


#: the core every run is pinned to (``BENCH_CORE``, default 0): on a shared
#: machine, the core the others leave free
CORE = os.environ.get("BENCH_CORE", "0")


def pinned(command: list[str]) -> list[str]:
    return (["taskset", "-c", CORE] if shutil.which("taskset") else []) + command


def run(command: list[str]) -> dict:
    """One fresh process; its last JSON line, or ``{"error": ...}``."""
    out = subprocess.run(pinned(command), capture_output=True, text=True, check=False)
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode or not lines:
        return {"error": (out.stderr or out.stdout).strip().splitlines()[-1:]}
    found: dict = json.loads(lines[-1])
    return found


def medians(found: list[dict]) -> dict:
    """The median of each timing field over the rounds that ran, and the
    last round's other fields."""
    good = [f for f in found if "error" not in f]
    if not good:
        return {"error": found[-1].get("error")}
    row = {k: v for k, v in good[-1].items() if k not in FIELDS}
    for key in FIELDS:
        if key in good[0]:
            row[key] = statistics.median(f[key] for f in good)
    return row


def rounds(commands: dict[str, list[str]], count: int) -> dict[str, dict]:
    """Every command run ``count`` times, the runs alternating within each
    round (each logged to stderr as it ends), and each one's medians."""
    found: dict[str, list[dict]] = {k: [] for k in commands}
    for r in range(count):
        for key, command in commands.items():
            result = run(command)
            found[key].append(result)
            print(f"round {r + 1} {key}: {result}", file=sys.stderr)
    return {k: medians(v) for k, v in found.items()}


def machine() -> str:
    """The CPU and TensorFlow's kernels this run measured on, as a fresh
    process of this interpreter reads them (``jacobkit.runtime.cpu_kind``):
    figures from different kinds of CPU are not comparable."""
    code = (
        "import tensorflow as tf; from jacobkit import runtime; "
        "k = runtime.cpu_kind(); "
        'print(f"{k.model}; TensorFlow {tf.__version__}, oneDNN '
        "{'on' if k.onednn else 'off'}\")"
    )
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env
    )
    lines = out.stdout.strip().splitlines()
    return lines[-1] if lines else "unknown"
