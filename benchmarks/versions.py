"""Two versions of jacobkit on the same reductions: this checkout against
another (a ``git worktree`` of an earlier commit), each measured against the
same plain gradient step in its own process.

Two versions cannot share one process, so each fresh process (pinned to one
core where ``taskset`` exists: ``BENCH_CORE``, 0 by default, as
``runs.pinned``) runs one version's reduction and the plain
step of ``reductions.py`` alternately, ``--rounds`` rounds of
``reductions.PAIRED_CALLS`` calls each, and reports the median per-round
ratio (reduction / plain step): a busy machine slows both sides of a round
alike. The processes of the two versions alternate too, and the table gives
each version's median ratio over its processes and their quotient (new /
old), with the first call (tracing included) beside it.

    git worktree add /tmp/base <commit>
    python benchmarks/versions.py --base /tmp/base --cases convnet,bert \\
        --methods "clipped sum,gram,projection" --processes 3
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import runs

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
CLIP = 1.0
DIM = 2048


def _method(name: str, built, jk, loss):  # noqa: ANN001 - jacobkit of either version
    """One call of the reduction ``name`` on the case ``built``."""
    import numpy as np

    variables = built.model.trainable_variables
    inputs = (built.x, built.y)
    if name == "clipped sum":
        return lambda: [
            np.asarray(v)
            for v in jk.jacobian(
                built.model,
                inputs,
                variables,
                outputs=loss,
                reduce=jk.ClippedSum(CLIP),
            ).values()
        ]
    if name == "projection":
        return lambda: [
            np.asarray(v)
            for v in jk.jacobian(
                built.model, inputs, variables, outputs=loss, reduce=jk.Project(DIM)
            ).values()
        ]
    if name == "gram":
        return lambda: [np.asarray(jk.gram(built.model, inputs, outputs=loss).matrix)]
    raise ValueError(f"unknown method {name!r}")


def child(case: str, method: str, rounds: int) -> None:
    """One version (the one on ``sys.path``): the first calls, then
    ``rounds`` paired rounds; one JSON line."""
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
    sys.path.insert(0, str(HERE))
    sys.path.insert(0, str(HERE / "peers"))
    import numpy as np
    import protocol
    import reductions
    import reductions_models

    import jacobkit as jk

    built = reductions_models.CASES[case]()
    loss = jk.Loss(reductions_models.loss())
    sides = {
        "plain": reductions.plain_step(built),
        "reduced": _method(method, built, jk, loss),
    }
    first = {}
    for name, call in sides.items():
        first[name] = protocol.timed(call)
        for _ in range(2):
            call()
    times = protocol.rotated(sides, rounds, reductions.PAIRED_CALLS)
    medians = {name: [float(np.median(t)) for t in times[name]] for name in sides}
    reduced = medians["reduced"]
    ratios = [r / p for r, p in zip(reduced, medians["plain"])]
    print(
        json.dumps(
            {
                "ratio": float(np.median(ratios)),
                "reduced_ms": 1e3 * float(np.median(reduced)),
                "first_s": first["reduced"],
                "plain_first_s": first["plain"],
                "jacobkit": str(Path(jk.__file__).parent.parent),
            }
        )
    )


def _run(checkout: Path, case: str, method: str, rounds: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(checkout), "TF_NUM_INTRAOP_THREADS": "1"}
    env["TF_NUM_INTEROP_THREADS"] = "1"
    command = [sys.executable, str(Path(__file__)), "--child", case, method]
    found = subprocess.run(
        runs.pinned([*command, "--rounds", str(rounds)]),
        env=env,
        cwd=str(checkout),
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(found.stdout.strip().splitlines()[-1])


def _medians(found: list[dict]) -> dict[str, float]:
    import numpy as np

    keys = [key for key in found[0] if key != "jacobkit"]
    return {key: float(np.median([run[key] for run in found])) for key in keys}


def _row(case: str, method: str, old: dict, new: dict) -> str:
    cells = [
        case,
        method,
        f"{old['ratio']:.3f}",
        f"{new['ratio']:.3f}",
        f"{new['ratio'] / old['ratio']:.3f}",
        f"{old['reduced_ms']:.1f}",
        f"{new['reduced_ms']:.1f}",
        f"{old['first_s']:.2f}",
        f"{new['first_s']:.2f}",
        f"{new['first_s'] / old['first_s']:.3f}",
    ]
    return "| " + " | ".join(cells) + " |"


HEADER = (
    "| case | method | old ÷ plain | new ÷ plain | new ÷ old | old ms | new ms "
    "| old first s | new first s | new ÷ old first |\n" + "|---" * 10 + "|"
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", nargs=2, metavar=("CASE", "METHOD"))
    parser.add_argument("--base", type=Path, help="the other checkout")
    parser.add_argument("--cases", default="convnet,bert")
    parser.add_argument("--methods", default="clipped sum,gram,projection")
    parser.add_argument("--processes", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    if args.child:
        child(*args.child, args.rounds)
        return
    if args.base is None:
        parser.error("--base: the checkout to compare with")
    rows = []
    for case in args.cases.split(","):
        for method in args.methods.split(","):
            done: dict[str, list[dict]] = {"new": [], "old": []}
            for _ in range(args.processes):
                for side, checkout in (("new", ROOT), ("old", args.base)):
                    done[side].append(_run(checkout, case, method, args.rounds))
            rows.append(
                _row(case, method, _medians(done["old"]), _medians(done["new"]))
            )
            print(rows[-1], flush=True)
    print(HEADER)
    print("\n".join(rows))


if __name__ == "__main__":
    main()
