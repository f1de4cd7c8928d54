"""The PNG plots: time and peak memory along each sweep, time versus chunk size."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from benchmarks.suite.rows import default_labels, rows_by_problem

_MIB = 1024**2


#: how to get matplotlib, which jacobkit needs only for these plots (from the
#: checkout's root, where the suite runs)
INSTALL_HINT = 'pip install -e ".[bench]"'


class MatplotlibMissing(ImportError):
    """matplotlib is not installed: it is in an extra (``bench``)."""


def require_matplotlib() -> None:
    """Raise :class:`MatplotlibMissing`, saying what failed and how to install
    it, unless matplotlib can be imported (the suite checks this before
    it runs, not after it)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as err:
        raise MatplotlibMissing(
            f"drawing the benchmark plots needs matplotlib, which could not be "
            f"imported ({err}); install it with: {INSTALL_HINT}"
        ) from err


def _pyplot():
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def sweeps(results: dict[str, Any]) -> dict[tuple[str, str], list[dict[str, Any]]]:
    """``(group, axis) -> problems on that sweep``, in increasing size."""
    found: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for problem in results["problems"]:
        for sweep in problem["sweeps"]:
            found.setdefault((sweep["group"], sweep["axis"]), []).append(problem)
    for (_, axis), problems in found.items():
        problems.sort(key=lambda p: p["sizes"][axis])
    return found


def _x_axis(problems: list[dict[str, Any]], axis: str) -> tuple[str, list[int]]:
    """Rows R when they vary along the sweep, else the swept size itself."""
    rows = [p["num_rows"] for p in problems]
    if len(set(rows)) == len(rows):
        return f"rows R ({axis} varies)", rows
    return f"{axis} (R = {rows[0]} rows)", [p["sizes"][axis] for p in problems]


def _grid(count: int) -> tuple[int, int]:
    columns = min(count, 3)
    return math.ceil(count / columns), columns


def _sweep_figure(results: dict[str, Any], metric: str, path: Path) -> Path:
    plt = _pyplot()
    found = sweeps(results)
    grouped = rows_by_problem(results)
    labels = default_labels(results)
    n_rows, n_cols = _grid(len(found))
    fig, axes = plt.subplots(
        n_rows, n_cols, figsize=(5.2 * n_cols, 4.0 * n_rows), squeeze=False
    )
    for ax, ((group, axis), problems) in zip(axes.flat, found.items()):
        x_label, xs = _x_axis(problems, axis)
        for label in labels:
            points = []
            for x, problem in zip(xs, problems):
                row = next(
                    (r for r in grouped[problem["problem"]] if r["strategy"] == label),
                    None,
                )
                if row and row.get("ok") and row.get(metric) is not None:
                    value = (
                        row[metric] / _MIB if metric == "peak_bytes" else row[metric]
                    )
                    points.append((x, max(value, 1e-3)))
            if points:
                ax.plot(*zip(*points), marker="o", label=label)
        ax.set_title(f"{group} (vs {axis})")
        ax.set_xlabel(x_label)
        ax.set_ylabel(
            "peak memory (MiB)" if metric == "peak_bytes" else "median time (s)"
        )
        ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:  # every run of the panel may have failed
            ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(found) :]:
        ax.set_visible(False)
    what = "peak memory" if metric == "peak_bytes" else "time per call"
    fig.suptitle(
        f"{what} by strategy ({results['settings']['device']}); failures omitted"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _chunk_figure(results: dict[str, Any], path: Path) -> Path:
    plt = _pyplot()
    grouped = rows_by_problem(results)
    problems = [
        p
        for p in results["problems"]
        if sum(r["name"] == "chunked" for r in grouped[p["problem"]]) > 1
    ]
    fig, axes = plt.subplots(
        max(len(problems), 1),
        2,
        figsize=(11, 4.0 * max(len(problems), 1)),
        squeeze=False,
    )
    for (ax_time, ax_mem), problem in zip(axes, problems):
        rows = grouped[problem["problem"]]
        chunked = sorted(
            (r for r in rows if r["name"] == "chunked" and r.get("ok")),
            key=lambda r: r["chunk_size"],
        )
        sizes = [r["chunk_size"] for r in chunked]
        ax_time.plot(
            sizes, [r["steady_s"] for r in chunked], marker="o", label="chunked"
        )
        with_peak = [r for r in chunked if r.get("peak_bytes") is not None]
        ax_mem.plot(
            [r["chunk_size"] for r in with_peak],
            [r["peak_bytes"] / _MIB for r in with_peak],
            marker="o",
            label="chunked",
        )
        for name, style in (("loop", ":"), ("jacobian", "--")):
            row = next((r for r in rows if r["strategy"] == name and r.get("ok")), None)
            if row:
                ax_time.axhline(
                    row["steady_s"], linestyle=style, color="gray", label=name
                )
                if row.get("peak_bytes") is not None:
                    ax_mem.axhline(
                        row["peak_bytes"] / _MIB,
                        linestyle=style,
                        color="gray",
                        label=name,
                    )
        for ax, unit in ((ax_time, "median time (s)"), (ax_mem, "peak memory (MiB)")):
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("chunk size (rows per vectorized pass)")
            ax.set_ylabel(unit)
            ax.set_title(
                f"{problem['problem']} (R = {problem['num_rows']})", fontsize=10
            )
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
    device = results["settings"]["device"]
    fig.suptitle(f"chunked: time and peak memory versus chunk size ({device})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_all(results: dict[str, Any], out_dir: str | Path) -> list[Path]:
    """``time_vs_rows.png``, ``memory_vs_rows.png`` and ``time_vs_chunk.png``
    (none for a suite without sweeps, such as ``auto``'s)."""
    out = Path(out_dir)
    if not sweeps(results):
        return []
    return [
        _sweep_figure(results, "steady_s", out / "time_vs_rows.png"),
        _sweep_figure(results, "peak_bytes", out / "memory_vs_rows.png"),
        _chunk_figure(results, out / "time_vs_chunk.png"),
    ]
