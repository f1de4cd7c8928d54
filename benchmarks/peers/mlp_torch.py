"""PyTorch on the benchmark MLP: every output feature's gradient (summed over
the batch) with respect to the first layer's weight and bias.

Runs in its own virtual environment (see README.md); prints one JSON line:

    python mlp_torch.py --weights mlp.npz --method jacrev --chunk-size 8
    python mlp_torch.py --weights mlp.npz --method loop
"""

from __future__ import annotations

import argparse
from typing import Any

import common
import footing
import numpy as np
import torch
from protocol import measure
from torch.func import functional_call, jacrev


def build(weights: dict[str, Any]) -> tuple[torch.nn.Module, torch.Tensor]:
    model = torch.nn.Sequential(
        common.linear(weights["hidden1_kernel"], weights["hidden1_bias"]),
        torch.nn.ReLU(),
        common.linear(weights["hidden2_kernel"], weights["hidden2_bias"]),
        torch.nn.Tanh(),
        common.linear(weights["head_kernel"], weights["head_bias"]),
    )
    return model, torch.from_numpy(weights["x"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--weights", default="mlp.npz")
    parser.add_argument("--method", choices=("jacrev", "loop"), default="jacrev")
    parser.add_argument("--chunk-size", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--save", help="write the kernel Jacobian (.npy) here")
    args = parser.parse_args()
    record = footing.pin_torch("mlp_torch", args.threads)
    model, x = build(common.load(args.weights))
    first = dict(model[0].named_parameters())

    def features(params: dict[str, torch.Tensor]) -> torch.Tensor:
        return model[1:](functional_call(model[0], params, (x,))).sum(0)

    if args.method == "jacrev":
        jac = jacrev(features, chunk_size=args.chunk_size)

        def call() -> list[torch.Tensor]:
            # no graph for the other layers' parameters (jacrev ignores an
            # outer no_grad for its own derivative)
            with torch.no_grad():
                out = jac({k: v.detach() for k, v in first.items()})
            return [out["weight"], out["bias"]]
    else:

        def call() -> list[torch.Tensor]:
            params = list(first.values())
            return common.row_by_row(model[1:](model[0](x)).sum(0), params)

    timings, result = measure(call, args.repeats)
    if args.save:
        # weight is (K, out, in): the transpose of the Keras kernel layout
        np.save(args.save, common.keras_rows(result[0].detach()).numpy())
    common.emit(
        {
            "peer": "pytorch",
            "method": args.method,
            "chunk_size": args.chunk_size,
            **timings,
            "footing": record,
        }
    )


if __name__ == "__main__":
    main()
