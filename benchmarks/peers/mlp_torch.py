"""PyTorch on the benchmark MLP: every output feature's gradient (summed over
the batch) with respect to the first layer's weight and bias.

Runs in its own virtual environment (see README.md); prints one JSON line:

    python mlp_torch.py --weights mlp.npz --method jacrev --chunk-size 8
    python mlp_torch.py --weights mlp.npz --method loop
"""

from __future__ import annotations

import argparse
import json

import footing
import numpy as np
import torch
from protocol import measure
from torch.func import functional_call, jacrev


def build(weights: dict[str, np.ndarray]) -> tuple[torch.nn.Module, torch.Tensor]:
    def linear(name: str) -> torch.nn.Linear:
        kernel = torch.from_numpy(weights[f"{name}_kernel"])
        layer = torch.nn.Linear(*kernel.shape)
        with torch.no_grad():
            layer.weight.copy_(kernel.T)
            layer.bias.copy_(torch.from_numpy(weights[f"{name}_bias"]))
        return layer

    model = torch.nn.Sequential(
        linear("hidden1"),
        torch.nn.ReLU(),
        linear("hidden2"),
        torch.nn.Tanh(),
        linear("head"),
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
    model, x = build(dict(np.load(args.weights)))
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
            params = [p for p in first.values()]
            rows = model[1:](model[0](x)).sum(0)
            weight = torch.empty((rows.shape[0], *params[0].shape))
            bias = torch.empty((rows.shape[0], *params[1].shape))
            for k in range(rows.shape[0]):
                weight[k], bias[k] = torch.autograd.grad(
                    rows[k], params, retain_graph=True
                )
            return [weight, bias]

    timings, result = measure(call, args.repeats)
    if args.save:
        # weight is (K, out, in): the transpose of the Keras kernel layout
        np.save(args.save, result[0].detach().transpose(1, 2).numpy())
    print(
        json.dumps(
            {
                "peer": "pytorch",
                "method": args.method,
                "chunk_size": args.chunk_size,
                **timings,
                "footing": record,
            }
        )
    )


if __name__ == "__main__":
    main()
