"""A peer framework's own GEMM rate: the same float32 product as
``mlp_limit.py``'s TensorFlow probe, (4096 x 1024) @ (1024 x 1024), in
PyTorch or JAX, one thread in a process pinned to one core; prints one JSON
line with GFLOP/s and the process's footing.

Why: each framework's matrix products run on its own library (TensorFlow's
oneDNN or Eigen, PyTorch's MKL, XLA's own), and on some CPUs they differ by
2x (a BLAS may pick its AVX2 kernels on a CPU it does not recognise). A
peer's share of the limit is read against its own rate as well as
TensorFlow's, so that a slow peer is seen to be slow in its products, not in
its Jacobian method.

    python gemm_probe.py --framework torch
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import common
import footing

M, K, N = 4096, 1024, 1024


def _rate(run: Callable[[], Any]) -> float:
    run()
    times = []
    for _ in range(7):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return 2 * M * K * N / statistics.median(times) / 1e9


def _torch() -> tuple[float, dict[str, Any]]:
    import torch

    record = footing.pin_torch("gemm_probe")
    a, b = torch.randn(M, K), torch.randn(K, N)
    with torch.no_grad():
        return _rate(lambda: torch.mm(a, b)), record


def _jax() -> tuple[float, dict[str, Any]]:
    footing.one_jax_thread()  # before JAX starts
    import jax

    record = footing.pin_jax("gemm_probe", jax.__version__)
    key_a, key_b = jax.random.split(jax.random.PRNGKey(0))
    a, b = jax.random.normal(key_a, (M, K)), jax.random.normal(key_b, (K, N))
    # the operands as arguments: a product of closed-over constants is
    # folded at compile time (it read 10,757 GFLOP/s)
    product = jax.jit(lambda a, b: a @ b)
    return _rate(lambda: product(a, b).block_until_ready()), record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--framework", choices=("torch", "jax"), required=True)
    args = parser.parse_args()
    rate, record = _torch() if args.framework == "torch" else _jax()
    common.emit({"peer": args.framework, "gflops": rate, "footing": record})


if __name__ == "__main__":
    main()
