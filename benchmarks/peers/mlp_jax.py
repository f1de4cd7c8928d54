"""JAX on the benchmark MLP: every output feature's gradient (summed over the
batch) with respect to the first layer's kernel and bias, as
``jax.lax.map`` over chunks of rows of one ``vjp``.

Runs in its own virtual environment (see README.md), pinned to one core (it
refuses to run otherwise) with XLA's CPU thread pools at one thread; prints
one JSON line:

    python mlp_jax.py --weights mlp.npz --batch-size 8
"""

from __future__ import annotations

import argparse
import json
import os

import footing

# one thread for XLA's CPU client, set before JAX starts
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from protocol import measure  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--weights", default="mlp.npz")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--save", help="write the kernel Jacobian (.npy) here")
    args = parser.parse_args()
    core = footing.require_pinned("mlp_jax")
    w = {k: jnp.asarray(v) for k, v in np.load(args.weights).items()}

    def features(kernel: jax.Array, bias: jax.Array) -> jax.Array:
        hidden = jax.nn.relu(w["x"] @ kernel + bias)
        hidden = jnp.tanh(hidden @ w["hidden2_kernel"] + w["hidden2_bias"])
        return (hidden @ w["head_kernel"] + w["head_bias"]).sum(0)

    @jax.jit
    def jacobian(kernel: jax.Array, bias: jax.Array) -> tuple[jax.Array, jax.Array]:
        rows, vjp = jax.vjp(features, kernel, bias)
        return jax.lax.map(vjp, jnp.eye(rows.shape[0]), batch_size=args.batch_size)

    def call() -> tuple[jax.Array, jax.Array]:
        out = jacobian(w["hidden1_kernel"], w["hidden1_bias"])
        jax.block_until_ready(out)
        return out

    timings, result = measure(call, args.repeats)
    if args.save:
        np.save(args.save, np.asarray(result[0]))
    print(
        json.dumps(
            {
                "peer": "jax",
                "method": f"lax.map(vjp, batch_size={args.batch_size})",
                **timings,
                "footing": {
                    "side": "jax",
                    "core": core,
                    "threads": 1,
                    **footing.machine(),
                    "versions": {**footing.versions(), "jax": jax.__version__},
                },
            }
        )
    )


if __name__ == "__main__":
    main()
