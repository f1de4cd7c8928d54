"""Benchmark result rows, grouped: by problem, by label, the defaults."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["by_label", "default_labels", "rows_by_problem"]


def rows_by_problem(results: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """Result rows grouped by problem id, in suite order."""
    grouped: dict[str, list[dict[str, Any]]] = {
        p["problem"]: [] for p in results["problems"]
    }
    for row in results["rows"]:
        grouped.setdefault(row["problem"], []).append(row)
    return grouped


def default_labels(results: dict[str, Any]) -> list[str]:
    """Labels of the strategies at their defaults (the first row of each
    registered name), in the order they ran."""
    labels: dict[str, str] = {}
    for row in results["rows"]:
        if row["default"]:
            labels.setdefault(row["name"], row["strategy"])
    return list(labels.values())


def by_label(rows: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Rows by their strategy label."""
    return {row["strategy"]: row for row in rows}
