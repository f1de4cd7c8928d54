"""PyTorch on the training-data attribution benchmark: captum's TracInCP
(scores and self-influence), TRAK's reference ``TRAKer`` and a hand-written
``torch.func.vmap(grad)`` TracIn, on the digits MLP's checkpoints and
ensemble that ``export_influence.py`` wrote, checked against jacobkit's
scores in that file.

Runs in its own virtual environment (see README.md), with ``captum`` and
``traker``; prints one JSON line per method:

    python influence_torch.py --npz influence.npz --method tracin_captum

Methods (``--method``, repeatable; default all whose package imports):

- ``plain_step``: the first checkpoint's summed-loss gradient over the
  training examples: the baseline every other method is divided by
  (``--paired-rounds``: also paired with it in one process), as jacobkit's
  side divides by TensorFlow's;

- ``tracin_captum``: ``captum.influence.TracInCP`` over the 3 checkpoints
  (saved to files, read back by a ``checkpoints_load_func`` that returns each
  checkpoint's learning rate), every parameter,
  ``influence((x_test, y_test), k=None)``: the ``(N_test, N_train)`` scores.
  ``--captum-grads batch`` (the default) takes per-example gradients from
  captum's per-layer hooks (``sample_wise_grads_per_batch=True``, loss
  ``CrossEntropyLoss(reduction="sum")``), ``loop`` from one backward pass per
  example (``reduction="none"``);
- ``self_influence_captum``: ``TracInCP.self_influence()`` of the training
  set, ``(N_train,)``;
- ``trak``: TRAK's ``TRAKer`` on the CPU (its ``BasicProjector``, Gaussian,
  ``proj_dim`` from the file, float32 as ``use_half_precision=False``) over
  the 10 ensemble models: ``featurize`` the training set, ``finalize_features``,
  ``score`` the test set, ``finalize_scores``; a fresh ``TRAKer`` in a fresh
  directory each call (it keeps its features on disk and would reuse them);
- ``trak_jacobkit_maps``: the same ``TRAKer`` run with jacobkit's projection
  maps (the file's ``trak_map_*``, as a custom projector that applies each
  as jacobkit does: a CountSketch's buckets and signs by ``index_add_``, one
  add per coordinate, not as the dense matrix it stands for) and a score
  computer that inverts ``ΦᵀΦ`` as the paper writes it: TRAK's
  ``BasicScoreComputer`` (traker 0.3.2) divides each model's ``(ΦᵀΦ)⁻¹`` by
  its mean magnitude (a float16 safeguard), which scales each model's scores
  by its own factor, and so weights the ensemble's models unequally;
  jacobkit, as the paper, does not. With the same maps and this one step
  undone, TRAK's own code must give jacobkit's scores;
- ``trak_jacobkit_maps_dense``: the same, each CountSketch applied as the
  dense ``(n, dim)`` matrix it stands for (built once, before the timed
  calls), by a matmul: at TRAK's size PyTorch's ``index_add_`` took 1.32x
  that matmul, so the peer is timed both ways and the comparison takes the
  faster (its fastest correct mode, as the reductions benchmark takes
  Opacus's); its check also holds the two ways to the tolerance against
  each other on random rows (``sketch_modes_err``);
- ``tracin_vmap``: per checkpoint ``torch.func.vmap(grad)`` per-example
  gradients of the test and the training set, flattened, ``G_test G_trainᵀ``
  times the learning rate, summed (what one writes by hand).

Each method's last timed result is checked: the TracIn scores and
self-influence against jacobkit's ``explain.tracin`` and
``explain.self_influence`` (the largest absolute difference over the largest
magnitude; one above ``--tolerance`` ends the run with an error and no line
for that method). TRAK's projections differ from jacobkit's, so only the
ranking can agree: its Spearman correlations with ``explain.trak``'s scores
(over the whole matrix, and the mean over the test examples' rows) are
reported, not checked; ``trak_jacobkit_maps``'s scores are checked as the
TracIn scores are. ``scores_per_s`` is the scores one call computes
(``N_test * N_train``; ``N_train`` for self-influence) over ``steady_s``.

Run each method in a fresh process where first calls compare: the methods
share PyTorch's and ``vmap``'s first-call setup.
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

# TRAKer's progress bars (tqdm reads its defaults from TQDM_*)
os.environ.setdefault("TQDM_DISABLE", "1")

import common  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from common import Run  # noqa: E402
from protocol import relative_error  # noqa: E402
from torch.func import functional_call, grad, vmap  # noqa: E402

METHODS = (
    "plain_step",
    "tracin_captum",
    "self_influence_captum",
    "trak",
    "trak_jacobkit_maps",
    "trak_jacobkit_maps_dense",
    "tracin_vmap",
)
#: the package each method needs beyond torch
NEEDS = {
    "tracin_captum": "captum",
    "self_influence_captum": "captum",
    "trak": "traker",
    "trak_jacobkit_maps": "traker",
    "trak_jacobkit_maps_dense": "traker",
}
#: how each TRAK method inverts ``ΦᵀΦ``: TRAK's ``BasicScoreComputer``, or
#: without its per-model rescaling (as the paper, and jacobkit)
TRAK_INVERSE = {
    "trak": "reference",
    "trak_jacobkit_maps": "unscaled",
    "trak_jacobkit_maps_dense": "unscaled",
}


def build() -> torch.nn.Sequential:
    """The MLP, Dense 64→32 relu → 10 logits, weights to be loaded."""
    return torch.nn.Sequential(
        OrderedDict(
            hidden=torch.nn.Linear(64, 32),
            relu=torch.nn.ReLU(),
            logits=torch.nn.Linear(32, 10),
        )
    )


def state(arrays: dict[str, np.ndarray], prefix: str, i: int) -> dict[str, Any]:
    """Model ``i`` of ``prefix`` (``checkpoint`` or ``ensemble``) as a
    state dict (Keras kernels ``(in, out)`` turned into weights ``(out,
    in)``)."""
    found = {}
    for layer in ("hidden", "logits"):
        kernel = torch.from_numpy(arrays[f"{prefix}_{layer}_kernel"][i])
        found[f"{layer}.weight"] = kernel.T.contiguous()
        found[f"{layer}.bias"] = torch.from_numpy(arrays[f"{prefix}_{layer}_bias"][i])
    return found


def error(got: Any, want: np.ndarray) -> float:
    """The largest absolute difference over the largest magnitude."""
    return relative_error(got, want, "influence_torch")


def spearman(got: Any, want: np.ndarray) -> dict[str, float]:
    """Rank agreement: over every score, and the mean over test rows."""
    from scipy.stats import spearmanr

    got = np.asarray(got, "float64")
    rows = [spearmanr(g, w)[0] for g, w in zip(got, want)]
    return {
        "spearman": float(spearmanr(got.ravel(), want.ravel())[0]),
        "spearman_per_test": float(np.nanmean(rows)),
    }


class Methods:
    """Each method's call (what is timed) and its check of the result."""

    def __init__(
        self, arrays: dict[str, np.ndarray], batch_size: int | None, captum_grads: str
    ) -> None:
        self.arrays = arrays
        self.x_train = torch.from_numpy(arrays["x_train"])
        self.y_train = torch.from_numpy(arrays["y_train"]).long()
        self.x_test = torch.from_numpy(arrays["x_test"])
        self.y_test = torch.from_numpy(arrays["y_test"]).long()
        self.n_train = len(self.x_train)
        self.n_test = len(self.x_test)
        self.batch_size = batch_size or self.n_train
        self.rates = [float(r) for r in arrays["learning_rates"]]
        self.checkpoints = len(self.rates)
        self.ensemble = len(arrays["ensemble_hidden_kernel"])
        self.dim = int(arrays["dim"])
        self.captum_grads = captum_grads
        self.directory = tempfile.TemporaryDirectory(prefix="influence_torch-")

    def batches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [
            (
                self.x_train[b : b + self.batch_size],
                self.y_train[b : b + self.batch_size],
            )
            for b in range(0, self.n_train, self.batch_size)
        ]

    def captum(self) -> Any:
        """captum's TracInCP over the checkpoints, saved as files."""
        from captum.influence import TracInCP

        rates = {}
        for c, rate in enumerate(self.rates):
            path = os.path.join(self.directory.name, f"checkpoint-{c}.pt")
            torch.save(state(self.arrays, "checkpoint", c), path)
            rates[path] = rate

        def load(model: torch.nn.Module, path: str) -> float:
            model.load_state_dict(torch.load(path))
            return rates[path]

        batch = self.captum_grads == "batch"
        return TracInCP(
            build(),
            torch.utils.data.TensorDataset(self.x_train, self.y_train),
            list(rates),
            checkpoints_load_func=load,
            loss_fn=torch.nn.CrossEntropyLoss(reduction="sum" if batch else "none"),
            batch_size=self.batch_size,
            sample_wise_grads_per_batch=batch,
        )

    def tracin_captum(self) -> Run:
        tracin = self.captum()

        def call() -> torch.Tensor:
            return tracin.influence((self.x_test, self.y_test), k=None)

        return call, lambda result: {
            "tracin_err": error(result.detach(), self.arrays["tracin"])
        }

    def self_influence_captum(self) -> Run:
        tracin = self.captum()

        def call() -> torch.Tensor:
            return tracin.self_influence()

        return call, lambda result: {
            "self_influence_err": error(result.detach(), self.arrays["self_influence"])
        }

    def traker(
        self,
        projector: Callable[[], Any] | None = None,
        score_computer: Any = None,
    ) -> Callable[[], np.ndarray]:
        """One TRAKer run over the ensemble: a fresh ``TRAKer`` (its
        ``BasicProjector``, or ``projector()``; its ``BasicScoreComputer``,
        or the class ``score_computer``), the training set featurized, the test set
        scored; the scores ``(N_test, N_train)``."""
        from trak import TRAKer
        from trak.projectors import BasicProjector

        ensemble = [state(self.arrays, "ensemble", m) for m in range(self.ensemble)]

        def call() -> np.ndarray:
            save_dir = tempfile.mkdtemp(prefix="trak-", dir=self.directory.name)
            traker = TRAKer(
                model=build(),
                task="image_classification",
                train_set_size=self.n_train,
                save_dir=save_dir,
                device="cpu",
                projector=None if projector is None else projector(),
                score_computer=score_computer,
                proj_dim=self.dim,
                use_half_precision=False,
                logging_level=logging.WARNING,
            )
            if projector is None:
                assert isinstance(traker.projector, BasicProjector), traker.projector
            for m, weights in enumerate(ensemble):
                traker.load_checkpoint(weights, model_id=m)
                for batch in self.batches():
                    traker.featurize(batch=batch, num_samples=len(batch[0]))
            traker.finalize_features()
            for m, weights in enumerate(ensemble):
                traker.start_scoring_checkpoint(
                    exp_name="test",
                    checkpoint=weights,
                    model_id=m,
                    num_targets=self.n_test,
                )
                traker.score(batch=(self.x_test, self.y_test), num_samples=self.n_test)
            # (N_train, N_test), a memory map in save_dir
            scores: np.ndarray = np.array(traker.finalize_scores(exp_name="test")).T
            return scores

        return call

    def trak(self) -> Run:
        return self.traker(), lambda result: spearman(result, self.arrays["trak"])

    def trak_jacobkit_maps_dense(self) -> Run:
        return self.trak_jacobkit_maps(dense=True)

    def trak_jacobkit_maps(self, dense: bool = False) -> Run:
        """TRAKer with jacobkit's maps, each CountSketch by ``index_add_``
        or (``dense``) by a matmul of the matrix it stands for."""
        from trak.projectors import AbstractProjector, ProjectionType
        from trak.score_computers import BasicScoreComputer

        # model m's map of each parameter's gradient (in its Keras layout),
        # as jacobkit holds it: a CountSketch's buckets and signs, or dense
        parts = ("buckets", "signs", "dense")
        maps = [
            {
                f"{layer}.{part}": {
                    kind: torch.from_numpy(self.arrays[f"{key}_{kind}"][m])
                    for kind in parts
                    if f"{key}_{kind}" in self.arrays
                }
                for layer in ("hidden", "logits")
                for part, key in (
                    ("weight", f"trak_map_{layer}_kernel"),
                    ("bias", f"trak_map_{layer}_bias"),
                )
            }
            for m in range(self.ensemble)
        ]
        agreement = {}
        for found in (f for model in maps for f in model.values()):
            if "buckets" in found:  # as index_add_ takes them, converted once
                found["buckets"] = found["buckets"].long()
            if "buckets" in found and dense:
                buckets, signs = found.pop("buckets"), found.pop("signs")
                found["dense"] = common.count_sketch_matrix(buckets, signs, self.dim)
                # the two ways on random rows: the same numbers
                rows = torch.randn(8, len(buckets), generator=torch.Generator())
                sketched = common.count_sketch(rows, buckets, signs, self.dim)
                agreement["sketch_modes_err"] = max(
                    agreement.get("sketch_modes_err", 0.0),
                    error(rows @ found["dense"], sketched.numpy()),
                )
        # the gradient's size: each map's rows
        size = sum(len(f.get("signs", f.get("dense"))) for f in maps[0].values())
        dim = self.dim

        class JacobkitMaps(AbstractProjector):
            """``sum_v M_v g_v`` with jacobkit's maps of model ``model_id``,
            each applied as jacobkit applies it: a CountSketch by one add per
            coordinate (``index_add_``; with ``dense``, as its matrix), a
            Gaussian map by a matmul."""

            def __init__(self) -> None:
                super().__init__(size, dim, 0, ProjectionType.normal, "cpu")

            def project(self, grads: Any, model_id: int) -> torch.Tensor:
                total = torch.zeros(next(iter(grads.values())).shape[0], dim)
                for name, g in grads.items():
                    rows = common.keras_rows(g).reshape(len(g), -1)
                    found = maps[model_id][name]
                    if "buckets" in found:
                        total += common.count_sketch(
                            rows, found["buckets"], found["signs"], dim
                        )
                    else:
                        total += rows @ found["dense"]
                return total

            def free_memory(self) -> None:
                pass

        class Unscaled(BasicScoreComputer):
            """``Φ (ΦᵀΦ)⁻¹`` as the paper writes it: ``BasicScoreComputer``
            divides each model's ``(ΦᵀΦ)⁻¹`` by its mean magnitude, which
            weights the ensemble's models unequally."""

            def get_x_xtx_inv(self, grads: torch.Tensor, xtx: torch.Tensor) -> Any:
                eye = torch.eye(len(xtx), dtype=xtx.dtype)
                inverse = torch.linalg.inv(xtx.float() + self.lambda_reg * eye)
                return grads @ inverse.to(self.dtype)

        def check(result: np.ndarray) -> dict[str, float]:
            return {
                **agreement,
                "trak_err": error(result, self.arrays["trak"]),
                **spearman(result, self.arrays["trak"]),
            }

        return self.traker(JacobkitMaps, Unscaled), check

    def plain_step(self) -> Run:
        """One plain training step on the first checkpoint: the gradient of
        the loss summed over the 1,000 training examples, every parameter
        (one forward and one backward pass): the baseline each method here
        is divided by, as jacobkit's side divides by TensorFlow's."""
        model = build()
        model.load_state_dict(state(self.arrays, "checkpoint", 0))
        params = list(model.parameters())

        def call() -> tuple[torch.Tensor, ...]:
            logits = model(self.x_train)
            loss = torch.nn.functional.cross_entropy(
                logits, self.y_train, reduction="sum"
            )
            return torch.autograd.grad(loss, params)

        return call, lambda result: {}

    def tracin_vmap(self) -> Run:
        model = build()
        params = [
            {k: v.detach() for k, v in state(self.arrays, "checkpoint", c).items()}
            for c in range(self.checkpoints)
        ]

        def loss(
            p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor
        ) -> torch.Tensor:
            logits = functional_call(model, p, (x[None],))
            return F.cross_entropy(logits, y[None])

        grads = vmap(grad(loss), in_dims=(None, 0, 0))

        def flat(g: dict[str, torch.Tensor]) -> torch.Tensor:
            return torch.cat([v.flatten(1) for v in g.values()], 1)

        def call() -> torch.Tensor:
            total = torch.zeros(self.n_test, self.n_train)
            for p, rate in zip(params, self.rates):
                test = flat(grads(p, self.x_test, self.y_test))
                train = flat(grads(p, self.x_train, self.y_train))
                total += rate * (test @ train.T)
            return total

        return call, lambda result: {"tracin_err": error(result, self.arrays["tracin"])}


def main() -> None:
    parser = common.method_parser(__doc__, "influence.npz", METHODS)
    parser.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="training examples per batch (captum, TRAK; default: all)",
    )
    parser.add_argument("--captum-grads", choices=("batch", "loop"), default="batch")
    args = parser.parse_args()
    record, methods = common.started("influence_torch", args, METHODS, NEEDS.get)
    versions = {p: common.version(p) for p in ("torch", "captum", "traker")}
    runs = Methods(common.load(args.npz), args.batch_size, args.captum_grads)

    def facts(method: str, timings: dict[str, Any], count: int) -> dict[str, Any]:
        return {
            **versions,
            "n_train": runs.n_train,
            "n_test": runs.n_test,
            "models": runs.ensemble if method in TRAK_INVERSE else runs.checkpoints,
            "batch_size": runs.batch_size,
            "threads": args.threads,
            **(
                {"dim": runs.dim, "trak_inverse": TRAK_INVERSE[method]}
                if method in TRAK_INVERSE
                else {}
            ),
            **(
                {"captum_grads": args.captum_grads}
                if method.endswith("_captum")
                else {}
            ),
            "scores_per_s": count / timings["steady_s"],
        }

    def scores(method: str, result: Any) -> int:
        """The scores one call computes (none for the plain step)."""
        return 0 if method == "plain_step" else int(np.prod(np.shape(result)))

    try:
        common.run_methods(
            "influence_torch", runs, methods, args, record, facts, kept=scores
        )
    finally:
        runs.directory.cleanup()


if __name__ == "__main__":
    main()
