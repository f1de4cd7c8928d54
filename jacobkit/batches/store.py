"""``out=`` directories: Jacobians as ``.npy`` files, a JSON manifest, resume.

A directory written by ``jacobian(..., out=DIR)`` holds, per target, one
``.npy`` file (readable with ``numpy.load(path, mmap_mode="r")``) and
``manifest.json``::

    {"version": 1,
     "fingerprint": {"model": ..., "targets": ..., "rows": ..., "inputs": ...},
     "kind": "rows" | "sum",
     "targets": [{"name": ..., "file": ..., "row_shape": [...], "dtype": ...}],
     "num_batches": int | null,
     "batches_done": k, "rows_done": n, "inputs_chain": "<sha256>",
     "sum_files": [...], "complete": bool}

``kind="rows"`` (``outputs="per_example"`` or ``"full"``): rows are written
into the ``.npy`` files batch by batch, in dataset order. When the number of
batches is known the files are created with ``numpy.lib.format.open_memmap``
for ``num_batches × first batch size`` rows; otherwise they grow batch by
batch behind a header of 4 KiB. At the end the header is rewritten in place
(same length) with the final row count, and the file cut to it.

``kind="sum"`` (``outputs="features"`` or a callable): the float64 running sum
is checkpointed after each batch into ``sum-<k>-<i>.npy``; the final files
are written, cast to the rows' dtype, at the end.

What "done" means: the first ``batches_done`` batches are in the files. A
batch is counted only after its data is flushed (``memmap.flush()`` and
``os.fsync``); then the manifest is rewritten atomically (a temporary file,
fsynced, and ``os.replace``). An interruption at any point (Ctrl-C,
``kill -9``, out of memory, a power cut) leaves the manifest describing data
that is on disk; rows written after it are overwritten on resume.

``inputs_chain`` is a hash chain over the batches done
(``sha256(previous + sha256(batch))``): a resumed call re-reads those batches
(reading is cheap next to their Jacobians), recomputes the chain and refuses
to continue if the inputs changed.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, BinaryIO

import numpy as np

from jacobkit.batches.manifest import (
    MANIFEST,
    Fingerprint,
    Json,
    Kind,
    Manifest,
    TargetFile,
    TargetSpec,
    chain,
    differences,
)

#: bytes before the data in a file whose row count is not known in advance
#: (a ``.npy`` header padded to this size; rewritten in place at the end)
_GROWING_HEADER = 4096


def _fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_file(
    path: str, write: Callable[[BinaryIO], None], *, atomic: bool = False
) -> None:
    """Write ``path`` with ``write(file)`` and flush it to disk. ``atomic``:
    write ``path.tmp`` and rename it over ``path`` (the rename fsynced too), so
    that ``path`` holds the old content or the new one, never a part."""
    written = path + ".tmp" if atomic else path
    with open(written, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    if atomic:
        os.replace(written, path)
        _fsync_path(os.path.dirname(path) or ".")  # the rename itself


def _save_npy(path: str, values: np.ndarray) -> None:
    """``np.save`` to ``path``, on disk when it returns."""
    _write_file(path, lambda f: np.save(f, values))


def _file_name(name: str, index: int) -> str:
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
    return f"{index:02d}-{safe}.npy"


class Store:
    """An ``out=`` directory being written (or resumed).

    Args:
        directory: the directory (created if missing).
        fingerprint: what identifies the call.
        targets: what each target's file holds.
        kind: ``"rows"`` or ``"sum"``.
        num_batches: the number of batches, ``None`` when not known in advance.
        rows_capacity: for ``kind="rows"``, the rows to allocate up front
            (``None``: the files grow batch by batch).
        overwrite: discard what the directory holds and start afresh.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        fingerprint: Fingerprint,
        targets: Sequence[TargetSpec],
        kind: Kind,
        num_batches: int | None,
        rows_capacity: int | None = None,
        overwrite: bool = False,
    ) -> None:
        self.directory = os.fspath(directory)
        if os.path.exists(self.directory) and not os.path.isdir(self.directory):
            raise ValueError(
                f"jacobian(out={self.directory!r}): a file, not a directory. Pass "
                "a directory (new, or one an earlier call wrote)."
            )
        self.kind = kind
        self.files = [
            TargetFile(t.name, _file_name(t.name, i), tuple(t.row_shape), str(t.dtype))
            for i, t in enumerate(targets)
        ]
        wanted = Manifest(
            fingerprint=fingerprint,
            kind=kind,
            targets=tuple(self.files),
            num_batches=num_batches,
        )
        existing = None if overwrite else self._read_manifest()
        if existing is not None:
            differs = differences(existing, wanted.to_json())
            if differs:
                raise ValueError(
                    f"jacobian(out={self.directory!r}): the directory holds the "
                    f"results of another call ({'; '.join(differs)}). Refusing to "
                    "mix them. Pass overwrite=True to start afresh, or choose "
                    "another out= directory."
                )
            self.manifest = wanted.progress_from(existing)
        else:
            os.makedirs(self.directory, exist_ok=True)
            self._remove_own_files()
            self.manifest = wanted
            if kind == "rows":
                self._create_row_files(rows_capacity)
            self._write_manifest()

    # -- reading the state ---------------------------------------------------
    @property
    def batches_done(self) -> int:
        return self.manifest.batches_done

    @property
    def rows_done(self) -> int:
        return self.manifest.rows_done

    @property
    def complete(self) -> bool:
        return self.manifest.complete

    @property
    def inputs_chain(self) -> str:
        return self.manifest.inputs_chain

    def saved_sum(self) -> list[np.ndarray] | None:
        """The float64 running sums of the batches done (``kind="sum"``)."""
        if not self.manifest.sum_files:
            return None
        return [
            np.load(os.path.join(self.directory, name))
            for name in self.manifest.sum_files
        ]

    def path(self, target: TargetFile) -> str:
        return os.path.join(self.directory, target.file)

    # -- writing -------------------------------------------------------------
    def write_rows(self, jacobians: Sequence[np.ndarray], batch_digest: str) -> None:
        """Append one batch's rows (each ``(n, *row_shape)``) after the rows
        done, flush them to disk, then count the batch done."""
        n = int(jacobians[0].shape[0])
        start = self.rows_done
        for target, values in zip(self.files, jacobians, strict=True):
            path = self.path(target)
            offset = self._data_offset(path) + start * target.row_bytes
            needed = offset + n * target.row_bytes
            if os.path.getsize(path) < needed:  # a growing file
                os.truncate(path, needed)
            if n:
                view = np.memmap(
                    path,
                    dtype=target.dtype,
                    mode="r+",
                    offset=offset,
                    shape=(n, *target.row_shape),
                )
                view[...] = values
                view.flush()
                del view  # unmapped: written pages do not stay in this process
            _fsync_path(path)
        self._batch_done(batch_digest, rows_done=start + n)

    def write_sum(self, sums: Sequence[np.ndarray], batch_digest: str) -> None:
        """Checkpoint the float64 running sums including this batch, then count
        the batch done (the previous checkpoint is removed afterwards)."""
        k = self.batches_done + 1
        names = []
        for i, values in enumerate(sums):
            name = f"sum-{k}-{i}.npy"
            _save_npy(os.path.join(self.directory, name), values)
            names.append(name)
        old = self.manifest.sum_files
        self._batch_done(batch_digest, sum_files=tuple(names))
        self._remove_files(old)

    def finish(self, sums: Sequence[np.ndarray] | None = None) -> dict[str, np.memmap]:
        """Write the final files (sums cast to their dtype; the final row count
        into a growing file's header), mark the run complete, and return each
        target's array memory-mapped read-only."""
        if not self.complete:
            if self.kind == "sum":
                assert sums is not None, "a sum store finishes with its sums"
                for target, values in zip(self.files, sums, strict=True):
                    _save_npy(
                        self.path(target), np.asarray(values).astype(target.dtype)
                    )
            else:
                for target in self.files:
                    path = self.path(target)
                    offset = self._data_offset(path)
                    _write_header(
                        path, (self.rows_done, *target.row_shape), target.dtype, offset
                    )
                    os.truncate(path, offset + self.rows_done * target.row_bytes)
                    _fsync_path(path)
            old = self.manifest.sum_files
            self.manifest = replace(self.manifest, sum_files=(), complete=True)
            self._write_manifest()
            self._remove_files(old)
        return {
            target.name: np.load(self.path(target), mmap_mode="r")
            for target in self.files
        }

    # -- internals -----------------------------------------------------------
    def _batch_done(self, batch_digest: str, **progress: Any) -> None:
        """Count one more batch done (with ``progress``: the manifest's new
        ``rows_done`` or ``sum_files``) and write the manifest."""
        self.manifest = replace(
            self.manifest,
            inputs_chain=chain(self.inputs_chain, batch_digest),
            batches_done=self.batches_done + 1,
            **progress,
        )
        self._write_manifest()

    def _create_row_files(self, rows_capacity: int | None) -> None:
        for target in self.files:
            path = self.path(target)
            if rows_capacity is None:
                _write_header(
                    path, (0, *target.row_shape), target.dtype, _GROWING_HEADER
                )
            else:
                array = np.lib.format.open_memmap(
                    path,
                    mode="w+",
                    dtype=target.dtype,
                    shape=(rows_capacity, *target.row_shape),
                )
                array.flush()
                del array

    @staticmethod
    def _data_offset(path: str) -> int:
        with open(path, "rb") as f:
            version = np.lib.format.read_magic(f)
            if version == (1, 0):
                np.lib.format.read_array_header_1_0(f)
            else:
                np.lib.format.read_array_header_2_0(f)
            return f.tell()

    def _read_manifest(self) -> dict[str, Json] | None:
        path = os.path.join(self.directory, MANIFEST)
        if not os.path.exists(path):
            return None
        with open(path) as f:
            try:
                return json.load(f)
            except json.JSONDecodeError as err:
                raise ValueError(
                    f"jacobian(out={self.directory!r}): {MANIFEST} there is not "
                    "valid JSON (not written by jacobkit?). Pass overwrite=True "
                    "to start afresh, or choose another out= directory."
                ) from err

    def _write_manifest(self) -> None:
        text = json.dumps(self.manifest.to_json(), indent=1, sort_keys=True)
        path = os.path.join(self.directory, MANIFEST)

        def write(f: BinaryIO) -> None:
            f.write(text.encode())

        _write_file(path, write, atomic=True)

    def _remove_files(self, names: Sequence[str]) -> None:
        for name in names:
            _remove(os.path.join(self.directory, name))

    def _remove_own_files(self) -> None:
        """The files an earlier run's manifest lists (overwrite=True starts
        afresh); nothing else in the directory is touched."""
        path = os.path.join(self.directory, MANIFEST)
        try:
            with open(path) as f:
                earlier = json.load(f)
        except (FileNotFoundError, json.JSONDecodeError):
            earlier = {}
        names = [MANIFEST, MANIFEST + ".tmp"]
        if isinstance(earlier, dict):
            names += [t.get("file", "") for t in earlier.get("targets", [])]
            names += list(earlier.get("sum_files", []))
        self._remove_files([n for n in names if n and os.path.basename(n) == n])


def _remove(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.remove(path)


def _write_header(path: str, shape: tuple[int, ...], dtype: str, size: int) -> None:
    """Write a version 1.0 ``.npy`` header for ``shape`` at the start of
    ``path``, padded to exactly ``size`` bytes (the data starts there)."""
    body = repr(
        {"descr": np.dtype(dtype).str, "fortran_order": False, "shape": tuple(shape)}
    ).encode("latin1")
    preamble = 10  # magic (6) + version (2) + header length (2)
    padding = size - preamble - len(body) - 1
    if padding < 0 or size - preamble > 0xFFFF:
        raise ValueError(f"a .npy header for shape {shape} does not fit {size} bytes")
    header = (
        b"\x93NUMPY\x01\x00"
        + (size - preamble).to_bytes(2, "little")
        + body
        + b" " * padding
        + b"\n"
    )
    with open(path, "r+b" if os.path.exists(path) else "wb") as f:
        f.write(header)
        f.flush()
        os.fsync(f.fileno())
