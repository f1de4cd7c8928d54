"""Write the users' wide generator's weights and inputs to ``generator.npz``
so the peer scripts (PyTorch, JAX) differentiate the very same function.

The generator is jacobkit's own (``jacobkit.testing.examples`` "generator"
at the suite's ``WIDE_GENERATOR`` sizes): inputs ``(B, T, C) = (64, 128,
16)``, Conv1D 16→64 (k=5, relu, ``conv1``, the target) → Conv1D 64→128 (k=5,
relu) → Conv1D 128→128 (k=3, tanh) → Dense 128→144, every convolution
``padding="same"``. The kernels are written in Keras's layouts (Conv1D
``(k, in, out)``, Dense ``(in, out)``).

    python benchmarks/peers/export_generator.py --out /tmp/generator.npz
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

# the repository's root: the suite's sizes, this checkout's jacobkit
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.suite.problems import WIDE_GENERATOR  # noqa: E402
from jacobkit.testing import examples  # noqa: E402

LAYERS = ("conv1", "conv2", "conv3", "head")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="generator.npz")
    args = parser.parse_args()
    example = examples.build("generator", **WIDE_GENERATOR)
    weights = {}
    for name in LAYERS:
        layer = example.model.get_layer(name)
        weights[f"{name}_kernel"] = np.asarray(layer.kernel)
        weights[f"{name}_bias"] = np.asarray(layer.bias)
    np.savez(args.out, x=np.asarray(example.inputs), **weights)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
