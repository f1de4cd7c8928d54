"""``manifest.json`` of an ``out=`` directory: what it holds, how far it got.

The file's format is described in :mod:`jacobkit.batches.store`; here are its
typed form (:class:`Manifest`), the parts that identify a call
(:class:`Fingerprint`, :class:`TargetFile`), the inputs hash chain, and the
comparison of a stored manifest with a new call's, in words.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

import numpy as np

MANIFEST = "manifest.json"
VERSION = 1
EMPTY_CHAIN = hashlib.sha256(b"jacobkit-inputs").hexdigest()

#: a value as JSON holds it (dicts, lists, str, numbers, bool, None)
Json = Any
#: ``"rows"``: rows in dataset order; ``"sum"``: rows summed over the batches
Kind = Literal["rows", "sum"]


@dataclass(frozen=True)
class Fingerprint:
    """What identifies the call that writes a directory (JSON values; see
    :func:`jacobkit.batches.fingerprint.fingerprint`): a resumed call must
    have the same."""

    model: str
    targets: Json
    rows: Json
    strategy: str
    inputs: Json

    def to_json(self) -> dict[str, Json]:
        return {
            "model": self.model,
            "targets": self.targets,
            "rows": self.rows,
            "strategy": self.strategy,
            "inputs": self.inputs,
        }


@dataclass(frozen=True)
class TargetSpec:
    """What one target's file holds: rows of shape ``row_shape`` (``v.shape``,
    with ``outputs="per_example"`` ``(F, *v.shape)``) of ``dtype``."""

    name: str
    row_shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True)
class TargetFile:
    """One target's file: ``name``, file name, shape of one row's Jacobian
    (``v.shape``, with ``outputs="per_example"`` ``(F, *v.shape)``), dtype."""

    name: str
    file: str
    row_shape: tuple[int, ...]
    dtype: str

    @property
    def row_bytes(self) -> int:
        return (
            int(np.prod(self.row_shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize
        )

    def to_json(self) -> dict[str, Json]:
        return {
            "name": self.name,
            "file": self.file,
            "row_shape": list(self.row_shape),
            "dtype": self.dtype,
        }


@dataclass(frozen=True)
class Manifest:
    """``manifest.json``: the call (``fingerprint``, ``kind``, ``targets``,
    ``num_batches``: ``None`` when not known in advance) and how far it got:
    the first ``batches_done`` batches (``rows_done`` rows, hash chain
    ``inputs_chain``) are on disk; ``sum_files`` hold their running sums."""

    fingerprint: Fingerprint
    kind: Kind
    targets: tuple[TargetFile, ...]
    num_batches: int | None
    batches_done: int = 0
    rows_done: int = 0
    inputs_chain: str = EMPTY_CHAIN
    sum_files: tuple[str, ...] = ()
    complete: bool = False
    version: int = VERSION

    def to_json(self) -> dict[str, Json]:
        return {
            "version": self.version,
            "fingerprint": self.fingerprint.to_json(),
            "kind": self.kind,
            "targets": [t.to_json() for t in self.targets],
            "num_batches": self.num_batches,
            "batches_done": self.batches_done,
            "rows_done": self.rows_done,
            "inputs_chain": self.inputs_chain,
            "sum_files": list(self.sum_files),
            "complete": self.complete,
        }

    def progress_from(self, stored: dict[str, Json]) -> Manifest:
        """This manifest with the progress of ``stored`` (a manifest's JSON
        describing the same call)."""
        return replace(
            self,
            batches_done=int(stored["batches_done"]),
            rows_done=int(stored["rows_done"]),
            inputs_chain=str(stored["inputs_chain"]),
            sum_files=tuple(stored["sum_files"]),
            complete=bool(stored["complete"]),
        )


def digest_batch(arrays: Sequence[np.ndarray]) -> str:
    """sha256 of a batch's arrays (shapes, dtypes and bytes)."""
    h = hashlib.sha256()
    for a in arrays:
        a = np.ascontiguousarray(a)
        h.update(f"{a.dtype.str}{a.shape}".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def chain(previous: str, batch_digest: str) -> str:
    """The next link of the inputs hash chain."""
    return hashlib.sha256((previous + batch_digest).encode()).hexdigest()


def differences(existing: dict[str, Any], wanted: dict[str, Any]) -> list[str]:
    """What differs between a stored manifest (its JSON, as read) and this
    call's (:meth:`Manifest.to_json`), in words."""
    if existing.get("version") != VERSION:
        return [f"manifest version {existing.get('version')!r}, expected {VERSION}"]
    differs = []
    stored, current = existing.get("fingerprint", {}), wanted["fingerprint"]
    for key in sorted(set(stored) | set(current)):
        if stored.get(key) != current.get(key):
            differs.append(
                f"{key} differ: stored {_short(stored.get(key))}, "
                f"this call {_short(current.get(key))}"
            )
    for key in ("kind", "targets", "num_batches"):
        if existing.get(key) != wanted[key]:
            differs.append(
                f"{key} differ: stored {_short(existing.get(key))}, "
                f"this call {_short(wanted[key])}"
            )
    return differs


def _short(value: Any, limit: int = 120) -> str:
    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= limit else text[: limit - 3] + "..."
