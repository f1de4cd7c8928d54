"""A separate process for ``test_plan_cache``: runs ``auto`` once on the small
MLP (writing the plan cache), then rewrites the entry many times, so that
two of these at once race on the same file.

Usage: ``python -m tests.cache_writer REWRITES`` with ``JACOBKIT_CACHE_DIR``
set; prints the entry's name.
"""

from __future__ import annotations

import glob
import os
import sys

import jacobkit as jk
from jacobkit.planner import cache
from jacobkit.testing import examples


def main(rewrites: int) -> None:
    ex = examples.build("mlp")
    jk.jacobian(ex.model, ex.inputs, ex.layer)
    (path,) = glob.glob(os.path.join(cache.directory(), "*.json"))
    name = os.path.basename(path)[: -len(".json")]
    entry = cache.load(name)
    for _ in range(rewrites):
        assert cache.save(name, entry)
    print(name)


if __name__ == "__main__":
    main(int(sys.argv[1]))
