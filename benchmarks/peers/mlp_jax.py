"""JAX on the benchmark MLP: every output feature's gradient (summed over the
batch) with respect to the first layer's kernel and bias, as
``jax.lax.map`` over chunks of rows of one ``vjp``.

Runs in its own virtual environment (see README.md); prints one JSON line:

    python mlp_jax.py --weights mlp.npz --batch-size 8
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np
from protocol import measure


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--weights", default="mlp.npz")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--save", help="write the kernel Jacobian (.npy) here")
    args = parser.parse_args()
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
            }
        )
    )


if __name__ == "__main__":
    main()
