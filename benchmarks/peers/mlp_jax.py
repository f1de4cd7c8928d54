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

import common
import footing

footing.one_jax_thread()  # before JAX starts

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
    record = footing.pin_jax("mlp_jax", jax.__version__)
    w = common.jax_arrays(args.weights)

    def features(kernel: jax.Array, bias: jax.Array) -> jax.Array:
        hidden = jax.nn.relu(w["x"] @ kernel + bias)
        hidden = jnp.tanh(hidden @ w["hidden2_kernel"] + w["hidden2_bias"])
        return (hidden @ w["head_kernel"] + w["head_bias"]).sum(0)

    jacobian = common.jax_rows(features, "lax_map", args.batch_size)
    timings, result = measure(
        lambda: jacobian(w["hidden1_kernel"], w["hidden1_bias"]), args.repeats
    )
    if args.save:
        np.save(args.save, np.asarray(result[0]))
    common.emit(
        {
            "peer": "jax",
            "method": f"lax.map(vjp, batch_size={args.batch_size})",
            **timings,
            "footing": record,
        }
    )


if __name__ == "__main__":
    main()
