"""PyTorch on the users' wide generator: every output feature's gradient
(summed over the batch and the positions) with respect to the first
Conv1D's weight and bias.

Runs in its own virtual environment (see README.md); prints one JSON line:

    python generator_torch.py --weights generator.npz --method jacrev --chunk-size 8
    python generator_torch.py --weights generator.npz --method vjp --chunk-size 8
    python generator_torch.py --weights generator.npz --method loop

``jacrev``: ``torch.func.jacrev(chunk_size=…)``; ``vjp``: one
``torch.func.vjp``, its backward function ``vmap``'d over chunks of the
one-hot rows (the forward pass once); ``loop``: one
``torch.autograd.grad`` per row on one graph.
"""

from __future__ import annotations

import argparse

import common
import footing
import numpy as np
import torch
from protocol import measure
from torch.func import functional_call, jacrev, vjp, vmap


class Generator(torch.nn.Module):
    """Keras's generator in PyTorch's layouts: Conv1D(padding="same") is
    ``Conv1d(padding=k // 2)`` on ``(B, C, T)``, the kernel ``(k, in, out)``
    becoming ``(out, in, k)``; the Dense head acts on the last axis of
    ``(B, T, C)``."""

    def __init__(self, weights: dict[str, np.ndarray]) -> None:
        super().__init__()
        self.conv1, self.conv2, self.conv3 = (
            common.conv(
                weights[f"{name}_kernel"],
                weights[f"{name}_bias"],
                padding=weights[f"{name}_kernel"].shape[0] // 2,
            )
            for name in ("conv1", "conv2", "conv3")
        )
        self.head = common.linear(weights["head_kernel"], weights["head_bias"])

    def after_conv1(self, h: torch.Tensor) -> torch.Tensor:
        """The rows (summed over the batch and the positions) from conv1's
        pre-activation ``(B, C, T)``."""
        h = torch.relu(self.conv2(torch.relu(h)))
        h = torch.tanh(self.conv3(h))
        return self.head(h.transpose(1, 2)).sum((0, 1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--weights", default="generator.npz")
    parser.add_argument("--method", choices=("jacrev", "vjp", "loop"), default="jacrev")
    parser.add_argument("--chunk-size", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--save", help="write the kernel Jacobian (.npy) here")
    args = parser.parse_args()
    record = footing.pin_torch("generator_torch", args.threads)
    weights = common.load(args.weights)
    model = Generator(weights)
    x = torch.from_numpy(weights["x"]).transpose(1, 2).contiguous()
    first = {k: v.detach() for k, v in model.conv1.named_parameters()}

    def features(params: dict[str, torch.Tensor]) -> torch.Tensor:
        return model.after_conv1(functional_call(model.conv1, params, (x,)))

    if args.method == "jacrev":
        jac = jacrev(features, chunk_size=args.chunk_size)

        def call() -> list[torch.Tensor]:
            # no graph for the other layers' parameters (jacrev ignores an
            # outer no_grad for its own derivative)
            with torch.no_grad():
                out = jac(first)
            return [out["weight"], out["bias"]]
    elif args.method == "vjp":

        def call() -> list[torch.Tensor]:
            with torch.no_grad():
                rows, back = vjp(features, first)
                eye = torch.eye(rows.shape[0], dtype=rows.dtype)
                size = args.chunk_size or rows.shape[0]
                parts = [
                    vmap(back)(eye[i : i + size]) for i in range(0, len(eye), size)
                ]
            return [
                torch.cat([p[0]["weight"] for p in parts]),
                torch.cat([p[0]["bias"] for p in parts]),
            ]
    else:

        def call() -> list[torch.Tensor]:
            params = list(model.conv1.parameters())
            return common.row_by_row(model.after_conv1(model.conv1(x)), params)

    timings, result = measure(call, args.repeats)
    if args.save:
        # weight is (K, out, in, k): Keras's kernel is (k, in, out)
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
