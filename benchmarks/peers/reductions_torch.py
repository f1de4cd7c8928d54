"""PyTorch on the reductions benchmark's ``convnet``: each example's loss
gradient over every parameter, reduced to DP-SGD's clipped sum, a Gram
matrix or a random projection, on the weights and batch that
``export_reductions.py`` wrote, checked against jacobkit's results in that
file.

Runs in its own virtual environment (see README.md), with ``opacus`` for
``clipped_opacus``; prints one JSON line per method:

    python reductions_torch.py --npz reductions.npz
    python reductions_torch.py --npz reductions.npz --method clipped_vmap

Methods (``--method``, repeatable; default all, ``clipped_opacus`` only where
Opacus imports):

- ``plain``: the gradient of the loss summed over the batch (one backward
  pass), the baseline;
- ``clipped_opacus``: Opacus's ghost clipping (``make_private`` with
  ``grad_sample_mode="ghost"``, flat clipping, no noise): the clipped sum
  (Opacus 1.6 takes the ``Linear`` layer's norms from their ghost form,
  the convolutions' from per-example gradients);
- ``clipped_vmap``: ``torch.func.vmap(grad)`` per-example gradients, their
  norms, each clipped to ``C``, summed;
- ``gram_vmap``: ``vmap(grad)``, flattened to ``J`` ``(B, P)``, ``J Jᵀ``;
- ``project_vmap``: ``vmap(grad)``, flattened, times a fixed Gaussian
  ``(P, dim)/sqrt(dim)`` matrix (as TRAK's ``BasicProjector``; made once,
  outside the timing; jacobkit's ``Project`` uses its own map, so only the
  time compares).

Run each method in a fresh process where first calls compare: the vmap
methods share ``vmap``'s first-call setup.

Every method's last timed result is checked before its line is printed: the
clipped sums and norms against jacobkit's ``ClippedSum``, the Gram matrix
against ``jk.gram``. The errors (largest absolute difference over the
largest magnitude, per array, the largest over the arrays) go to stderr and
into the JSON line; one above ``--tolerance`` ends the run with an error.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from protocol import measure, relative_error
from torch.func import functional_call, grad, vmap

METHODS = ("plain", "clipped_opacus", "clipped_vmap", "gram_vmap", "project_vmap")

#: a method: its call (timed) and the check of the call's result (the errors)
Run = tuple[Callable[[], Any], Callable[[Any], dict[str, float]]]


def build(arrays: dict[str, np.ndarray]) -> torch.nn.Sequential:
    """The convnet with the exported weights (Keras layouts turned into
    PyTorch's)."""

    def conv(name: str, stride: int) -> torch.nn.Conv2d:
        kernel = torch.from_numpy(arrays[f"{name}_kernel"])  # (kh, kw, in, out)
        kh, kw, cin, cout = kernel.shape
        layer = torch.nn.Conv2d(cin, cout, (kh, kw), stride=stride)
        layer.load_state_dict(
            {
                "weight": kernel.permute(3, 2, 0, 1),  # (out, in, kh, kw)
                "bias": torch.from_numpy(arrays[f"{name}_bias"]),
            }
        )
        return layer

    kernel = torch.from_numpy(arrays["head_kernel"])  # (in, out)
    head = torch.nn.Linear(*kernel.shape)
    head.load_state_dict(
        {"weight": kernel.T, "bias": torch.from_numpy(arrays["head_bias"])}
    )
    return torch.nn.Sequential(
        OrderedDict(
            conv1=conv("conv1", 1),
            relu1=torch.nn.ReLU(),
            conv2=conv("conv2", 2),
            relu2=torch.nn.ReLU(),
            pool=torch.nn.AdaptiveAvgPool2d(1),
            flatten=torch.nn.Flatten(),
            head=head,
        )
    )


def keras_layout(name: str, value: torch.Tensor) -> np.ndarray:
    """A parameter-shaped tensor (``conv1.weight``) in the Keras layout of
    the variable it stands for."""
    array = value.detach()
    if name.endswith("weight"):
        array = array.T if array.ndim == 2 else array.permute(2, 3, 1, 0)
    return array.numpy()


def keras_name(name: str) -> str:
    """``conv1.weight`` -> ``conv1_kernel`` (the exported arrays' names)."""
    layer, part = name.split(".")
    return f"{layer}_{'kernel' if part == 'weight' else 'bias'}"


def error(got: Any, want: np.ndarray) -> float:
    """The largest absolute difference over the largest magnitude."""
    return relative_error(got, want, "reductions_torch")


def clipped_errors(
    clipped: dict[str, torch.Tensor], norms: Any, arrays: dict[str, np.ndarray]
) -> dict[str, float]:
    return {
        "clipped_err": max(
            error(keras_layout(k, v), arrays["clipped_" + keras_name(k)])
            for k, v in clipped.items()
        ),
        "norms_err": error(norms, arrays["norms"]),
    }


def opacus_version() -> str | None:
    try:
        import opacus
    except ImportError:
        return None
    return str(opacus.__version__)


class Methods:
    """Each method's call (what is timed) and its check of the result."""

    def __init__(self, arrays: dict[str, np.ndarray], dim: int, seed: int) -> None:
        self.arrays = arrays
        self.clip = float(arrays["clip"])
        # NHWC -> NCHW
        self.x = torch.from_numpy(arrays["x"]).permute(0, 3, 1, 2).contiguous()
        self.y = torch.from_numpy(arrays["y"]).long()
        self.batch = self.x.shape[0]
        self.dim = dim
        self.seed = seed

    # the per-example gradients every vmap method starts from
    def per_example(self) -> Callable[[], dict[str, torch.Tensor]]:
        model = build(self.arrays)
        params = {k: v.detach() for k, v in model.named_parameters()}

        def loss(
            p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor
        ) -> torch.Tensor:
            logits = functional_call(model, p, (x[None],))
            return F.cross_entropy(logits, y[None])

        grads = vmap(grad(loss), in_dims=(None, 0, 0))
        return lambda: grads(params, self.x, self.y)

    def flat(self, grads: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.cat([g.reshape(self.batch, -1) for g in grads.values()], 1)

    def plain(self) -> Run:
        model = build(self.arrays)
        params = list(model.parameters())

        def call() -> tuple[torch.Tensor, ...]:
            loss = F.cross_entropy(model(self.x), self.y, reduction="sum")
            return torch.autograd.grad(loss, params)

        return call, lambda result: {}

    def clipped_opacus(self) -> Run:
        from opacus import PrivacyEngine

        model = build(self.arrays)
        loader = torch.utils.data.DataLoader(
            torch.utils.data.TensorDataset(self.x, self.y), batch_size=self.batch
        )
        module, optimizer, criterion, _ = PrivacyEngine().make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
            criterion=torch.nn.CrossEntropyLoss(),
            data_loader=loader,
            noise_multiplier=0.0,
            max_grad_norm=self.clip,
            poisson_sampling=False,
            clipping="flat",
            grad_sample_mode="ghost",
        )
        module.train()
        named = list(model.named_parameters())
        expected = optimizer.expected_batch_size

        def call() -> list[torch.Tensor]:
            optimizer.zero_grad(set_to_none=True)
            criterion(module(self.x), self.y).backward()
            # adds the (zero) noise, then divides by the expected batch size
            optimizer.pre_step()
            return [p.grad for _, p in named if p.grad is not None]

        def check(result: list[torch.Tensor]) -> dict[str, float]:
            # undo the averaging: the sum of the clipped gradients
            clipped = {k: g * expected for (k, _), g in zip(named, result)}
            return clipped_errors(
                clipped, module.per_sample_gradient_norms, self.arrays
            )

        return call, check

    def clipped_vmap(self) -> Run:
        per_example = self.per_example()

        def call() -> tuple[dict[str, torch.Tensor], torch.Tensor]:
            grads = per_example()
            squares = [
                g.reshape(self.batch, -1).square().sum(1) for g in grads.values()
            ]
            norms = torch.stack(squares).sum(0).sqrt()
            scale = (self.clip / norms).clamp(max=1.0)
            clipped = {k: torch.tensordot(scale, g, 1) for k, g in grads.items()}
            return clipped, norms

        return call, lambda result: clipped_errors(result[0], result[1], self.arrays)

    def gram_vmap(self) -> Run:
        per_example = self.per_example()

        def call() -> torch.Tensor:
            rows = self.flat(per_example())
            return rows @ rows.T

        return call, lambda result: {"gram_err": error(result, self.arrays["gram"])}

    def project_vmap(self) -> Run:
        per_example = self.per_example()
        size = sum(p.numel() for p in build(self.arrays).parameters())
        generator = torch.Generator().manual_seed(self.seed)
        projection = torch.randn(size, self.dim, generator=generator)
        projection /= math.sqrt(self.dim)

        def call() -> torch.Tensor:
            return self.flat(per_example()) @ projection

        return call, lambda result: {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--npz", default="reductions.npz")
    parser.add_argument("--method", choices=METHODS, action="append")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dim", type=int, default=2048, help="projection_vmap's dim")
    parser.add_argument("--seed", type=int, default=0, help="of the projection")
    parser.add_argument("--tolerance", type=float, default=1e-4)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    opacus = opacus_version()
    methods = args.method or [m for m in METHODS if opacus or m != "clipped_opacus"]
    if "clipped_opacus" in methods and opacus is None:
        raise SystemExit("reductions_torch: clipped_opacus needs opacus installed")
    if opacus is None and args.method is None:
        print("reductions_torch: no opacus, clipped_opacus skipped", file=sys.stderr)
    runs = Methods(dict(np.load(args.npz)), args.dim, args.seed)
    failed = []
    for method in methods:
        call, check = getattr(runs, method)()
        timings, result = measure(call, args.repeats)
        errors = check(result)
        del result
        print(
            f"reductions_torch: {method}: "
            + (", ".join(f"{k} {v:.2e}" for k, v in errors.items()) or "no check"),
            file=sys.stderr,
        )
        if any(not v <= args.tolerance for v in errors.values()):
            failed.append(method)
            continue
        print(
            json.dumps(
                {
                    "peer": "torch",
                    "method": method,
                    "torch": torch.__version__,
                    "opacus": opacus,
                    "batch": runs.batch,
                    "threads": args.threads,
                    **({"dim": args.dim} if method == "project_vmap" else {}),
                    **errors,
                    **timings,
                }
            ),
            flush=True,
        )
    if failed:
        raise SystemExit(
            f"reductions_torch: {', '.join(failed)} disagree with jacobkit's "
            f"results in {args.npz} (tolerance {args.tolerance:g})"
        )


if __name__ == "__main__":
    main()
