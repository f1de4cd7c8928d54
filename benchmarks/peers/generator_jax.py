"""JAX on the users' wide generator: every output feature's gradient (summed
over the batch and the positions) with respect to the first Conv1D's kernel
and bias, as ``jax.lax.map`` over chunks of rows of one ``vjp``
(``--method lax_map``), or ``vmap`` of the ``vjp`` over chunks of rows
unrolled in the compiled function (``--method vmap``; ``--batch-size 144``:
one ``vmap`` over every row). ``--conv xla`` writes the convolutions as
``lax.conv_general_dilated``; ``--conv gemm`` (the default: the fastest
here) as ``k`` shifted matmuls, the same function.

Runs in its own virtual environment (see README.md), pinned to one core (it
refuses to run otherwise) with XLA's CPU thread pools at one thread; prints
one JSON line:

    python generator_jax.py --weights generator.npz --batch-size 1
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


def conv_xla(h: jax.Array, kernel: jax.Array, bias: jax.Array) -> jax.Array:
    """Keras's Conv1D(padding="same") as XLA's convolution: ``h`` (B, T,
    in), ``kernel`` (k, in, out) -> (B, T, out)."""
    out = jax.lax.conv_general_dilated(
        h, kernel, (1,), "SAME", dimension_numbers=("NWC", "WIO", "NWC")
    )
    return out + bias


def conv_gemm(h: jax.Array, kernel: jax.Array, bias: jax.Array) -> jax.Array:
    """The same convolution as ``k`` shifted matmuls (odd ``k``): XLA's CPU
    convolution gradients measured 10-20x slower than its matmuls here."""
    k, length = kernel.shape[0], h.shape[1]
    padded = jnp.pad(h, ((0, 0), (k // 2, k // 2), (0, 0)))
    return sum(padded[:, j : j + length] @ kernel[j] for j in range(k)) + bias


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--weights", default="generator.npz")
    parser.add_argument("--method", choices=("lax_map", "vmap"), default="lax_map")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--conv", choices=("gemm", "xla"), default="gemm")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--save", help="write the kernel Jacobian (.npy) here")
    args = parser.parse_args()
    record = footing.pin_jax("generator_jax", jax.__version__)
    w = common.jax_arrays(args.weights)
    conv = conv_gemm if args.conv == "gemm" else conv_xla

    def features(kernel: jax.Array, bias: jax.Array) -> jax.Array:
        h = jax.nn.relu(conv(w["x"], kernel, bias))
        h = jax.nn.relu(conv(h, w["conv2_kernel"], w["conv2_bias"]))
        h = jnp.tanh(conv(h, w["conv3_kernel"], w["conv3_bias"]))
        return (h @ w["head_kernel"] + w["head_bias"]).sum((0, 1))

    jacobian = common.jax_rows(features, args.method, args.batch_size)
    timings, result = measure(
        lambda: jacobian(w["conv1_kernel"], w["conv1_bias"]), args.repeats
    )
    if args.save:
        np.save(args.save, np.asarray(result[0]))
    name = "lax.map(vjp" if args.method == "lax_map" else "vmap(vjp) over chunks"
    common.emit(
        {
            "peer": "jax",
            "method": f"{name}, batch_size={args.batch_size}), {args.conv} conv",
            **timings,
            "footing": record,
        }
    )


if __name__ == "__main__":
    main()
