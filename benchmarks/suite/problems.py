"""The benchmark problems: the examples of :mod:`jacobkit.testing.examples` at sizes
that say something, grouped into sweeps.

A :class:`BenchProblem` names a builder, its sizes, the target layer and the
``outputs`` mode. A sweep is the same model with one size varied; a problem
may sit on several sweeps (the 144-feature generator is on both the feature
and the batch sweep). :func:`quick_suite` runs in a few minutes on two CPU
cores; :func:`full_suite` is the recorded one.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

#: what each reference kind is, in words (for the tables)
REFERENCES = {
    "float64": "float64 eager loop (`jacobkit.testing.reference_jacobian`) "
    "on a float64 copy of the example (`jacobkit.testing.float64_copy`: every "
    "layer and variable float64, nested models included)",
    "float32-loop": "float32 `loop` strategy (one `tape.gradient` per row)",
}


@dataclass(frozen=True)
class Sweep:
    """A panel of the plots: ``group`` names the model, ``axis`` the size
    that varies along it."""

    group: str
    axis: str


@dataclass(frozen=True)
class BenchProblem:
    """One model at one size, and what to differentiate.

    Attributes:
        id: unique and readable: ``"generator-conv1-F144-B16"``.
        builder: a name in :data:`jacobkit.testing.examples.BUILDERS`.
        sizes: keyword sizes for the builder.
        layer: the target layer (``None``: the example's own).
        outputs: ``"features"`` or ``"per_example"``.
        reference: a key of :data:`REFERENCES`.
        sweeps: the sweeps this problem is a point of.
        chunk_sizes: extra ``chunked`` chunk sizes to run on this problem
            (the time-versus-chunk-size plot).
        headline: shown in the headline table.
        auto_targets: ``auto`` is checked against the fastest fixed strategy
            on this problem (the auto table of ``results.md``).
        skip: strategy names not run on this problem, each too slow at its
            size to say anything (``loop``: one eager pass per row).
    """

    id: str
    builder: str
    sizes: dict[str, int]
    layer: str | None = None
    outputs: str = "features"
    reference: str = "float64"
    sweeps: tuple[Sweep, ...] = ()
    chunk_sizes: tuple[int, ...] = ()
    headline: bool = False
    auto_targets: bool = False
    skip: tuple[str, ...] = ()

    @property
    def num_rows(self) -> int:
        """Rows R of the Jacobian: F for ``"features"``, B*F per example."""
        features = self.sizes.get("features", self.sizes.get("classes", 0))
        if self.outputs == "per_example":
            return self.sizes["batch"] * features
        return features

    def to_dict(self) -> dict[str, Any]:
        """The problem's fields as they appear on every result row."""
        return {
            "problem": self.id,
            "builder": self.builder,
            "sizes": dict(self.sizes),
            "layer": self.layer,
            "outputs": self.outputs,
            "num_rows": self.num_rows,
            "reference": self.reference,
            "sweeps": [{"group": s.group, "axis": s.axis} for s in self.sweeps],
            "headline": self.headline,
            "auto_targets": self.auto_targets,
        }


def merge_duplicates(problems: list[BenchProblem]) -> list[BenchProblem]:
    """One problem per id, in first-seen order, with the sweeps, chunk sizes
    and headline flags of its duplicates merged in."""
    merged: dict[str, BenchProblem] = {}
    for problem in problems:
        first = merged.get(problem.id)
        if first is None:
            merged[problem.id] = problem
            continue
        merged[problem.id] = replace(
            first,
            sweeps=first.sweeps
            + tuple(s for s in problem.sweeps if s not in first.sweeps),
            chunk_sizes=tuple(sorted({*first.chunk_sizes, *problem.chunk_sizes})),
            headline=first.headline or problem.headline,
        )
    return list(merged.values())


def _generator(
    target: str, base: dict[str, int], sweep: Sweep, **sizes: int
) -> BenchProblem:
    sizes = {**base, **sizes}
    return BenchProblem(
        id=f"generator-{target}-F{sizes['features']}-B{sizes['batch']}",
        builder="generator",
        sizes=sizes,
        layer=target,
        sweeps=(sweep,),
    )


def _spectrogram(base: dict[str, int], sweep: Sweep, **sizes: int) -> BenchProblem:
    sizes = {**base, **sizes}
    return BenchProblem(
        id=f"spectrogram-dense-F{sizes['features']}-B{sizes['batch']}",
        builder="spectrogram",
        sizes=sizes,
        layer="dense",
        outputs="per_example",
        sweeps=(sweep,),
    )


def _mlp(base: dict[str, int], sweep: Sweep, **sizes: int) -> BenchProblem:
    sizes = {**base, **sizes}
    return BenchProblem(
        id=f"mlp-hidden1-F{sizes['features']}-B{sizes['batch']}",
        builder="mlp",
        sizes=sizes,
        layer="hidden1",
        sweeps=(sweep,),
    )


def _resnet(base: dict[str, int], sweep: Sweep, **sizes: int) -> BenchProblem:
    sizes = {**base, **sizes}
    return BenchProblem(
        id=f"resnet50-head-C{sizes['classes']}-B{sizes['batch']}-{sizes['size']}px",
        builder="frozen_resnet",
        sizes=sizes,
        layer="head",
        reference="float32-loop",
        sweeps=(sweep,),
    )


def _flag(problems: list[BenchProblem], **changes: Any) -> list[BenchProblem]:
    """The last problem of a sweep (the largest) with ``changes`` applied."""
    return [*problems[:-1], replace(problems[-1], **changes)]


def quick_suite() -> list[BenchProblem]:
    """Small problems, every strategy on each: a few minutes on two cores."""
    gen = {"sequence": 16, "channels": 4, "filters": 8}
    spec = {"frames": 12, "bins": 10, "filters": 8, "hidden": 32}
    mlp = {"inputs": 16, "hidden": 32}
    generator = [
        _generator(
            "conv1", gen, Sweep("generator conv1", "features"), features=f, batch=4
        )
        for f in (8, 16)
    ]
    return merge_duplicates(
        [
            *_flag(generator, chunk_sizes=(4,), headline=True),
            *_flag(
                [
                    _spectrogram(
                        spec, Sweep("spectrogram dense", "batch"), features=3, batch=2
                    )
                ],
                headline=True,
            ),
            *_flag(
                [_mlp(mlp, Sweep("mlp hidden1", "features"), features=16, batch=32)],
                headline=True,
            ),
        ]
    )


def full_suite() -> list[BenchProblem]:
    """The recorded suite: realistic sizes, sweeps over features and batch."""
    gen = {"sequence": 64, "channels": 8, "filters": 32}
    spec = {"frames": 40, "bins": 32, "filters": 16, "hidden": 128}
    mlp = {"inputs": 64, "hidden": 256}
    resnet = {"size": 64, "classes": 3}
    conv1_f = Sweep("generator conv1", "features")
    conv1_b = Sweep("generator conv1", "batch")
    head_f = Sweep("generator head", "features")
    spec_f = Sweep("spectrogram dense", "features")
    spec_b = Sweep("spectrogram dense", "batch")
    problems = [
        *_flag(
            [
                _generator("conv1", gen, conv1_f, features=f, batch=16)
                for f in (16, 48, 96, 144)
            ],
            chunk_sizes=(1, 4, 64, 144),
            headline=True,
        ),
        *[
            _generator("conv1", gen, conv1_b, features=144, batch=b)
            for b in (4, 16, 64)
        ],
        *_flag(
            [
                _generator("head", gen, head_f, features=f, batch=16)
                for f in (16, 48, 96, 144)
            ],
            headline=True,
        ),
        *_flag(
            [_spectrogram(spec, spec_f, features=f, batch=4) for f in (2, 4, 8)],
            chunk_sizes=(1, 4, 32),
            headline=True,
        ),
        *[_spectrogram(spec, spec_b, features=4, batch=b) for b in (2, 4, 8)],
        *_flag(
            [
                _resnet(resnet, Sweep("resnet50 head", "batch"), batch=b)
                for b in (4, 16)
            ],
            headline=True,
        ),
        *_flag(
            [
                _mlp(mlp, Sweep("mlp hidden1", "features"), features=f, batch=256)
                for f in (16, 64, 144)
            ],
            headline=True,
        ),
    ]
    return merge_duplicates(problems)


#: the users' wide generator (issue 8): B=64, T=128, C=16 with Conv1D
#: 64/128/128 -> Dense(144); ``auto``'s headline and ``conv_gradients.py``'s
WIDE_GENERATOR = {
    "batch": 64,
    "sequence": 128,
    "channels": 16,
    "filters": 64,
    "filters2": 128,
    "filters3": 128,
    "features": 144,
}


def auto_suite() -> list[BenchProblem]:
    """The problems of ``auto``'s targets (issue 8): the users' generator at
    B=64, T=128, C=16 with Conv1D 64/128/128 → Dense(144), target the first
    Conv1D; and an MLP 512→1024→1024→144 at B=256, target the first Dense
    (``loop`` and ``forward`` not run: minutes per call at these sizes); then
    the users' frozen backbones (:func:`frozen_heads`)."""
    slow = ("loop", "forward")
    return [
        BenchProblem(
            id="generator-conv1-F144-B64-wide",
            builder="generator",
            sizes=dict(WIDE_GENERATOR),
            layer="conv1",
            chunk_sizes=(8, 36),
            headline=True,
            auto_targets=True,
            skip=slow,
        ),
        BenchProblem(
            id="mlp-hidden1-F144-B256-wide",
            builder="mlp",
            sizes={"batch": 256, "inputs": 512, "hidden": 1024, "features": 144},
            layer="hidden1",
            chunk_sizes=(36,),
            headline=True,
            auto_targets=True,
            skip=slow,
        ),
        *frozen_heads(),
    ]


def _frozen_head(builder: str, name: str, layer: str, **sizes: int) -> BenchProblem:
    """A users' model with a frozen backbone (issue 20): its 3-class head
    ``layer`` is the target, 3 rows, where tracing is most of a first call.
    ``loop`` runs (the answer with no tracing); ``forward`` does not (a pass
    per head parameter)."""
    size = f"-{sizes['size']}px" if "size" in sizes else f"-T{sizes['sequence']}"
    return BenchProblem(
        id=f"{name}-head-C{sizes['classes']}-B{sizes['batch']}{size}",
        builder=builder,
        sizes=sizes,
        layer=layer,
        reference="float32-loop",
        headline=True,
        auto_targets=True,
        skip=("forward",),
    )


def frozen_heads() -> list[BenchProblem]:
    """Frozen MobileNetV2, ResNet50 (the seed's case: 96 px, 16 images) and
    a keras_hub BERT classifier (2 layers of width 128, 64 tokens), each
    with a 3-class head."""
    return [
        _frozen_head(
            "frozen_mobilenet", "mobilenet_v2", "head", batch=16, size=96, classes=3
        ),
        _frozen_head("frozen_resnet", "resnet50", "head", batch=16, size=96, classes=3),
        _frozen_head(
            "bert_classifier",
            "bert",
            "logits",
            batch=16,
            sequence=64,
            classes=3,
            hidden=128,
        ),
    ]


#: the auto-quick suite's sizes, per builder
_QUICK_SIZES: dict[str, dict[str, int]] = {
    "generator": {"sequence": 32, "filters": 8, "filters2": 16, "filters3": 16},
    "mlp": {"inputs": 32, "hidden": 64},
    "frozen_mobilenet": {"size": 32},
    "frozen_resnet": {"size": 32},
    "bert_classifier": {"sequence": 16, "hidden": 32},
}


def auto_quick_suite() -> list[BenchProblem]:
    """:func:`auto_suite` at small sizes (a check of the machinery)."""
    found = []
    for problem in auto_suite():
        sizes = {**problem.sizes, "batch": 8, **_QUICK_SIZES[problem.builder]}
        if "features" in sizes:
            sizes["features"] = 48
        found.append(
            replace(
                problem,
                id=f"{problem.builder}-{problem.layer}-small",
                sizes=sizes,
                chunk_sizes=(8,) if problem.chunk_sizes else (),
            )
        )
    return found


SUITES = {
    "quick": quick_suite,
    "full": full_suite,
    "auto": auto_suite,
    "auto-quick": auto_quick_suite,
}
