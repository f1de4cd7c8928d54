"""Write the benchmark MLP's weights and inputs to ``mlp.npz`` so the peer
scripts (PyTorch, JAX) differentiate the very same function.

The MLP is jacobkit's benchmark one (``jacobkit.testing.example_models.mlp``):
Dense 512→1024 (relu, ``hidden1``, the target) → Dense 1024→1024 (tanh) →
Dense 1024→144, B=256.

    python benchmarks/peers/export_mlp.py --out /tmp/mlp.npz
"""

from __future__ import annotations

import argparse

import numpy as np

from jacobkit.testing import example_models

SIZES = {"batch": 256, "inputs": 512, "hidden": 1024, "features": 144}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="mlp.npz")
    args = parser.parse_args()
    example = example_models.mlp(**SIZES)
    weights = {}
    for name in ("hidden1", "hidden2", "head"):
        layer = example.model.get_layer(name)
        weights[f"{name}_kernel"] = np.asarray(layer.kernel)
        weights[f"{name}_bias"] = np.asarray(layer.bias)
    np.savez(args.out, x=np.asarray(example.inputs), **weights)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
