"""PyTorch on the reductions benchmark's ``convnet``, ``bert`` (and
``bert_small``) and ``gpt2``: each example's loss gradient over every
parameter, reduced to DP-SGD's clipped sum, a Gram matrix or a random
projection, on the weights and batch that ``export_reductions.py`` wrote,
checked against jacobkit's results in that file. BERT runs as Hugging Face's
``BertForSequenceClassification``, GPT-2 as its ``GPT2LMHeadModel`` (each
example's loss its mean next-token cross-entropy; ``lm_head`` tied to the
token table, one parameter).

Runs in its own virtual environment (see README.md), with ``opacus`` for
its methods, pinned to one core (it refuses to run otherwise: ``taskset -c
N``) with one PyTorch thread; prints one JSON line per method, with the
machine, PyTorch's MKLDNN state and every version (``footing.py``):

    taskset -c 0 python reductions_torch.py --npz reductions.npz
    taskset -c 0 python reductions_torch.py --npz reductions.npz --method clipped_vmap

Methods (``--method``, repeatable; default all, Opacus's only where it
imports):

- ``plain``: the gradient of the loss summed over the batch (one backward
  pass): the baseline every other method here is divided by (jacobkit's
  side divides by TensorFlow's own plain step);
- ``clipped_opacus_<mode>``, ``<mode>`` each of Opacus's ways of taking
  per-example gradients: ``hooks``, ``functorch`` and ``ew`` (expanded
  weights; ``GradSampleModule``'s modes) and ``ghost`` (ghost clipping,
  ``make_private(grad_sample_mode="ghost")``; Opacus 1.6 takes the
  ``Linear`` layer's norms from their ghost form, the convolutions' from
  per-example gradients): ``make_private`` with flat clipping at C and no
  noise, forward, backward and the optimizer's ``pre_step`` (clip, sum,
  the zero noise, the average): the clipped sum;
- ``clipped_vmap``: ``torch.func.vmap(grad)`` per-example gradients, their
  norms, each clipped to ``C``, summed;
- ``gram_vmap``: ``vmap(grad)``, flattened to ``J`` ``(B, P)``, ``J Jᵀ``;
- ``project_vmap``: ``vmap(grad)``, each parameter's gradients mapped by the
  very map jacobkit's ``reduce=jk.Project(dim)`` draws for that variable
  (exported to the file: dense, or LoGra's Kronecker factors, applied as
  ``jacobkit.problem.sketch`` applies them to materialized gradients);
- ``sgd_step``: one plain training step (forward, the mean loss, backward,
  ``torch.optim.SGD``'s update): the DP step's baseline;
- ``dp_step_opacus_<mode>``: one DP-SGD training step of ``make_private``
  (flat clipping at C, noise σ = :data:`NOISE`, SGD), each mode as above.

Run each method in a fresh process where first calls compare: the vmap
methods share ``vmap``'s first-call setup.

A method that raises (an Opacus mode that refuses the model) or whose
result disagrees prints no line; the run's last line names each such method
with the reason ("not supported (...)", "disagrees with jacobkit (...)"),
which the benchmark records in place of a time.

Every method's last timed result is checked before its line is printed: the
clipped sums and norms against jacobkit's ``ClippedSum`` (Opacus's norms
from its per-example gradients, or ghost clipping's own), the Gram matrix
against ``jk.gram``, the projection against ``jk.Project``'s; a DP step by
a twin without noise at learning rate 1, whose update times the batch must
be jacobkit's clipped sum. The errors (largest absolute difference over the
largest magnitude, per array, the largest over the arrays) go to stderr and
into the JSON line; a method above ``--tolerance``, or one that raises,
prints no line, and the run ends with an error after the others.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import common
import numpy as np
import torch
import torch.nn.functional as F
from common import Run
from protocol import relative_error
from torch.func import functional_call, grad, vmap

#: Opacus's ways of taking per-example gradients (``GradSampleModule``'s
#: modes, and ghost clipping through ``make_private``)
OPACUS_MODES = ("hooks", "functorch", "ew", "ghost")
METHODS = (
    "plain",
    *(f"clipped_opacus_{m}" for m in OPACUS_MODES),
    "clipped_vmap",
    "gram_vmap",
    "project_vmap",
    "sgd_step",
    *(f"dp_step_opacus_{m}" for m in OPACUS_MODES),
)
#: the cases exported under Hugging Face's names and layouts
HF_CASES = ("bert", "gpt2")
#: the DP step's noise multiplier (DP-SGD's σ; its time includes drawing it)
NOISE = 1.0
#: the DP and plain steps' learning rate
LR = 0.01


class Classifier(torch.nn.Module):
    """Hugging Face's ``BertForSequenceClassification`` called on one int
    tensor ``(B, 3, T)`` (token ids, segment ids, padding mask), so that
    every method feeds it as it feeds the convnet its images; the position
    ids are passed per example (Opacus's per-example hooks need every
    input's batch axis)."""

    def __init__(self, hf: torch.nn.Module) -> None:
        super().__init__()
        self.hf = hf

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # no attention mask: the file's padding masks are all ones (checked
        # on loading), and Hugging Face's mask preparation branches on the
        # mask's values, which vmap cannot trace
        positions = torch.arange(x.shape[-1]).expand(x.shape[0], -1).contiguous()
        return self.hf(
            input_ids=x[:, 0].contiguous(),
            token_type_ids=x[:, 1].contiguous(),
            position_ids=positions,
        ).logits


def build_bert(arrays: dict[str, np.ndarray]) -> Classifier:
    """BERT tiny as ``export_reductions.py --case bert`` wrote it: keras_hub's
    ``BertTextClassifier`` as ``BertForSequenceClassification`` (tanh GELU,
    keras_hub's ``gelu_approximate``; epsilon 1e-12; dropout 0, as the
    Keras model runs in inference mode), with its weights."""
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(
        vocab_size=int(arrays["vocabulary_size"]),
        hidden_size=int(arrays["hidden_dim"]),
        num_hidden_layers=int(arrays["num_layers"]),
        num_attention_heads=int(arrays["num_heads"]),
        intermediate_size=int(arrays["intermediate_dim"]),
        hidden_act="gelu_new",
        max_position_embeddings=int(arrays["max_sequence_length"]),
        type_vocab_size=2,
        layer_norm_eps=1e-12,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        classifier_dropout=0.0,
        num_labels=int(arrays["num_classes"]),
        attn_implementation="eager",
    )
    if not np.all(arrays["padding_mask"] == 1):
        raise SystemExit("reductions_torch: BERT runs without a mask: pad nothing")
    model = BertForSequenceClassification(config)
    weights = {
        k[len("hf__") :]: torch.from_numpy(arrays[k])
        for k in arrays
        if k.startswith("hf__")
    }
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if unexpected or [m for m in missing if "position_ids" not in m]:
        raise SystemExit(
            f"reductions_torch: BERT weights missing {missing}, unexpected {unexpected}"
        )
    return Classifier(model)


class CausalLM(torch.nn.Module):
    """Hugging Face's ``GPT2LMHeadModel`` called on token ids ``(B, T)``,
    returning logits ``(B, T, V)``; the position ids are passed per example
    (Opacus's per-example hooks need every input's batch axis) and no
    attention mask (nothing is padded: checked on loading), as for BERT."""

    def __init__(self, hf: torch.nn.Module) -> None:
        super().__init__()
        self.hf = hf

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(x.shape[-1]).expand(x.shape[0], -1).contiguous()
        return self.hf(input_ids=x, position_ids=positions).logits


def build_gpt2(arrays: dict[str, np.ndarray]) -> CausalLM:
    """The causal LM as ``export_reductions.py --case gpt2`` wrote it:
    ``tokens_torch.build``'s ``GPT2LMHeadModel`` (tanh GELU, dropout 0,
    ``lm_head`` tied to ``transformer.wte``, eager attention) with the
    file's weights, trainable."""
    import tokens_torch

    model = tokens_torch.build(arrays)
    for parameter in model.parameters():
        parameter.requires_grad_(True)
    return CausalLM(model)


def build(arrays: dict[str, np.ndarray]) -> torch.nn.Module:
    """The file's model with its weights: the convnet (Keras layouts turned
    into PyTorch's), BERT (``build_bert``) or GPT-2 (``build_gpt2``)."""
    if str(arrays.get("case", "convnet")) == "bert":
        return build_bert(arrays)
    if str(arrays.get("case", "convnet")) == "gpt2":
        return build_gpt2(arrays)

    def conv(name: str, stride: int) -> torch.nn.Conv2d:
        kernel = arrays[f"{name}_kernel"]  # (kh, kw, in, out)
        layer: torch.nn.Conv2d = common.conv(
            kernel, arrays[f"{name}_bias"], stride=stride
        )
        return layer

    head = common.linear(arrays["head_kernel"], arrays["head_bias"])
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
    if name.endswith("weight"):  # the parameter as a row of one
        array = common.keras_rows(array[None])[0]
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
    """The clipped sum's error (the largest over the parameters) and, where
    ``norms`` are given, the norms' against jacobkit's."""
    if str(arrays.get("case", "convnet")) in HF_CASES:  # PyTorch's names, layouts
        pairs = [
            (v.detach().numpy(), arrays["clipped__" + k.removeprefix("hf.")])
            for k, v in clipped.items()
        ]
    else:
        pairs = [
            (keras_layout(k, v), arrays["clipped_" + keras_name(k)])
            for k, v in clipped.items()
        ]
    # over every parameter at once: a gradient that is 0 in exact arithmetic
    # (an attention key's bias) holds rounding noise alone, which its own
    # largest magnitude would turn into an error of order 1
    found = {
        "clipped_err": error(
            np.concatenate([np.ravel(g) for g, _ in pairs]),
            np.concatenate([np.ravel(w) for _, w in pairs]),
        )
    }
    if norms is not None:
        found["norms_err"] = error(norms, arrays["norms"])
    return found


class Methods:
    """Each method's call (what is timed) and its check of the result."""

    def __init__(self, arrays: dict[str, np.ndarray], threads: int) -> None:
        self.arrays = arrays
        self.clip = float(arrays["clip"])
        self.case = str(arrays.get("case", "convnet"))
        if self.case == "bert":  # (B, 3, T): token ids, segment ids, mask
            parts = ("token_ids", "segment_ids", "padding_mask")
            self.x = torch.from_numpy(np.stack([arrays[p] for p in parts], 1)).long()
        elif self.case == "gpt2":  # token ids (B, T); labels (B, T)
            self.x = torch.from_numpy(arrays["token_ids"]).long()
        else:  # NHWC -> NCHW
            self.x = torch.from_numpy(arrays["x"]).permute(0, 3, 1, 2).contiguous()
        self.y = torch.from_numpy(arrays["y"]).long()
        self.batch = self.x.shape[0]
        self.threads = threads

    def summed(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The batch's summed loss: each example's cross-entropy, or on GPT-2
        each sequence's mean next-token cross-entropy."""
        if self.case == "gpt2":
            tokens = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum")
            return tokens / y.shape[-1]
        return F.cross_entropy(logits, y, reduction="sum")

    def mean(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The batch's mean loss (of one example: its loss)."""
        if self.case == "gpt2":  # every sequence has T tokens
            return F.cross_entropy(logits.flatten(0, 1), y.flatten())
        return F.cross_entropy(logits, y)

    def criterion(
        self, criterion: Any, logits: torch.Tensor, y: torch.Tensor, mode: str
    ) -> Any:
        """Opacus's criterion (``torch.nn.CrossEntropyLoss``, or ghost
        clipping's wrapper of it) on the batch: on GPT-2 over the flattened
        tokens (the mean over the batch of each sequence's mean), ghost
        clipping told the logits' shape so that it takes each sequence's
        mean as that example's loss (Opacus's way for generative models)."""
        if self.case != "gpt2":
            return criterion(logits, y)
        shape = {"shape": logits.shape} if mode == "ghost" else {}
        return criterion(logits.flatten(0, 1), y.flatten(), **shape)

    def __getattr__(self, name: str) -> Any:
        """``clipped_opacus_<mode>`` and ``dp_step_opacus_<mode>``."""
        for prefix, make in (
            ("clipped_opacus_", self.clipped_opacus),
            ("dp_step_opacus_", self.dp_step_opacus),
        ):
            if name.startswith(prefix) and name[len(prefix) :] in OPACUS_MODES:
                mode = name[len(prefix) :]
                return lambda: make(mode)
        raise AttributeError(name)

    # the per-example gradients every vmap method starts from
    def per_example(self) -> Callable[[], dict[str, torch.Tensor]]:
        model = build(self.arrays)
        params = {k: v.detach() for k, v in model.named_parameters()}

        def loss(
            p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor
        ) -> torch.Tensor:
            logits = functional_call(model, p, (x[None],))
            return self.mean(logits, y[None])

        grads = vmap(grad(loss), in_dims=(None, 0, 0))
        return lambda: grads(params, self.x, self.y)

    def keras_rows(self, name: str, g: torch.Tensor) -> torch.Tensor:
        """Per-example gradients ``(B, *shape)`` of parameter ``name`` in
        the Keras layout of the variable it stands for."""
        if self.case == "bert":  # each change a transpose of a 2-D view
            hf = name.removeprefix("hf.")
            shape = [int(n) for n in self.arrays[f"kshape__{hf}"]]
            if str(self.arrays[f"layout__{hf}"]) != "same" and g.ndim == 3:
                g = g.transpose(1, 2)
            return g.reshape(self.batch, *shape)
        return common.keras_rows(g)

    def flat(self, grads: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.cat([g.reshape(self.batch, -1) for g in grads.values()], 1)

    def plain(self) -> Run:
        model = build(self.arrays)
        params = list(model.parameters())

        def call() -> tuple[torch.Tensor, ...]:
            loss = self.summed(model(self.x), self.y)
            return torch.autograd.grad(loss, params)

        def check(result: Any) -> dict[str, float]:
            if "logits" not in self.arrays:
                return {}
            with torch.no_grad():  # the same function as the Keras model
                return {"logits_err": error(model(self.x), self.arrays["logits"])}

        return call, check

    def private(self, mode: str, noise: float, lr: float) -> tuple[Any, ...]:
        """Opacus's ``make_private`` on a fresh copy of the convnet, flat
        clipping at C, one batch of the whole batch (no Poisson sampling):
        the wrapped module, its optimizer, the criterion and the model."""
        from opacus import PrivacyEngine

        model = build(self.arrays)
        loader = torch.utils.data.DataLoader(
            torch.utils.data.TensorDataset(self.x, self.y), batch_size=self.batch
        )
        found = PrivacyEngine().make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=lr),
            criterion=torch.nn.CrossEntropyLoss(),
            data_loader=loader,
            noise_multiplier=noise,
            max_grad_norm=self.clip,
            poisson_sampling=False,
            clipping="flat",
            grad_sample_mode=mode,
        )
        # ghost clipping returns its own criterion (two backward passes)
        criterion = found[2] if mode == "ghost" else torch.nn.CrossEntropyLoss()
        found[0].train()
        return found[0], found[1], criterion, model

    def clipped_opacus(self, mode: str) -> Run:
        """Opacus's clipped sum in ``mode``, no noise: what
        ``jk.ClippedSum(C)`` returns (the optimizer's averaging undone in the
        check)."""
        module, optimizer, criterion, model = self.private(mode, 0.0, 0.0)
        named = list(model.named_parameters())
        expected = optimizer.expected_batch_size

        def call() -> list[torch.Tensor]:
            optimizer.zero_grad(set_to_none=True)
            self.criterion(criterion, module(self.x), self.y, mode).backward()
            # clips and sums, adds the (zero) noise, divides by the batch
            optimizer.pre_step()
            return [p.grad for _, p in named if p.grad is not None]

        def check(result: list[torch.Tensor]) -> dict[str, float]:
            clipped = {k: g * expected for (k, _), g in zip(named, result)}
            if mode == "ghost":
                norms = module.per_sample_gradient_norms
            else:  # the norms Opacus clipped by, from its per-example gradients
                squares = [
                    p.grad_sample.reshape(self.batch, -1).square().sum(1)
                    for _, p in named
                ]
                norms = torch.stack(squares).sum(0).sqrt()
            return clipped_errors(clipped, norms, self.arrays)

        return call, check

    def dp_step_opacus(self, mode: str) -> Run:
        """One DP-SGD training step in Opacus's ``mode``: forward, backward,
        clip, sum, Gaussian noise (σ = :data:`NOISE`), the SGD update. Its
        check is a twin without noise at learning rate 1 whose update
        (times the batch) must be jacobkit's clipped sum."""
        module, optimizer, criterion, _ = self.private(mode, NOISE, LR)

        def step(module: Any, optimizer: Any, criterion: Any) -> None:
            optimizer.zero_grad(set_to_none=True)
            self.criterion(criterion, module(self.x), self.y, mode).backward()
            optimizer.step()

        def call() -> None:
            step(module, optimizer, criterion)

        def check(result: None) -> dict[str, float]:
            twin, twin_optimizer, twin_criterion, model = self.private(mode, 0.0, 1.0)
            before = {k: v.detach().clone() for k, v in model.named_parameters()}
            step(twin, twin_optimizer, twin_criterion)
            clipped = {
                k: (before[k] - v.detach()) * twin_optimizer.expected_batch_size
                for k, v in model.named_parameters()
            }
            return clipped_errors(clipped, None, self.arrays)

        return call, check

    def sgd_step(self) -> Run:
        """One plain SGD training step (forward, the batch's mean loss,
        backward, the update): the DP step's own baseline."""
        model = build(self.arrays)
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)

        def call() -> None:
            optimizer.zero_grad(set_to_none=True)
            self.mean(model(self.x), self.y).backward()
            optimizer.step()

        return call, lambda result: {}

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
        """``vmap(grad)``, each parameter's gradients in its Keras layout
        mapped by jacobkit's own map of that variable (exported): a
        CountSketch's buckets and signs (``index_add_``, one add per
        coordinate, as jacobkit's segment sum), a dense ``(size, dim)``
        matrix, or the Kronecker factors ``L``, ``R``
        (``vec(Lᵀ G R)[:dim] / sqrt(dim)``, as ``jacobkit.problem.sketch``
        applies them to materialized gradients); the sum over parameters.
        Checked against jacobkit's ``reduce=jk.Project(dim)``."""
        per_example = self.per_example()
        maps = {}
        # GPT-2's maps are per Keras variable (gpt2_projection), not per
        # parameter: c_attn holds three variables
        names = [] if self.case == "gpt2" else build(self.arrays).named_parameters()
        for name in (n for n, _ in names):
            key = (
                "map__" + name.removeprefix("hf.")
                if self.case == "bert"
                else "map_" + keras_name(name)
            )
            maps[name] = {
                part: torch.from_numpy(self.arrays[f"{key}_{part}"])
                for part in ("dense", "left", "right", "buckets", "signs")
                if f"{key}_{part}" in self.arrays
            }
        dim = int(self.arrays["dim"])

        def mapped(name: str, g: torch.Tensor) -> torch.Tensor:
            return by_map(maps[name], self.keras_rows(name, g))

        def by_map(found: dict[str, torch.Tensor], g: torch.Tensor) -> torch.Tensor:
            """Per-example gradients ``g`` ``(B, *shape)`` of one Keras
            variable, in its layout, mapped by its map ``found``."""
            if "buckets" in found:  # a CountSketch: one add per coordinate
                rows = g.reshape(self.batch, -1)
                return common.count_sketch(rows, found["buckets"], found["signs"], dim)
            if "dense" in found:
                return g.reshape(self.batch, -1) @ found["dense"]
            units = g.shape[-1]
            right = g.reshape(-1, units) @ found["right"]  # (B I, s)
            right = right.reshape(self.batch, -1, right.shape[-1])  # (B, I, s)
            both = torch.einsum("ia,rib->rab", found["left"], right)
            return both.reshape(self.batch, -1)[:, :dim] / math.sqrt(dim)

        def call() -> torch.Tensor:
            grads = per_example()
            return sum(mapped(k, g) for k, g in grads.items())

        if self.case == "gpt2":
            call = self.gpt2_projection(per_example, by_map)
        return call, lambda result: {
            "projection_err": error(result, self.arrays["projection"])
        }

    def gpt2_projection(
        self, per_example: Callable[[], dict[str, torch.Tensor]], by_map: Any
    ) -> Callable[[], torch.Tensor]:
        """GPT-2's projection: each Keras variable ``i`` taken out of its
        Hugging Face parameter's per-example gradients by the file's view
        (``view__<i>_index``: a reshape where the variable is the whole
        parameter in its order, else a gather: the query, key and value
        kernels and biases out of ``c_attn``), mapped by its own map
        (``map__<i>_*``); the sum over the variables."""
        views = []
        count = sum(k.startswith("view__") and k.endswith("_name") for k in self.arrays)
        for i in range(count):
            index = torch.from_numpy(self.arrays[f"view__{i}_index"])
            name = "hf." + str(self.arrays[f"view__{i}_name"])
            size = self.arrays[name.removeprefix("hf.")].size
            whole = index.numel() == size and bool(
                torch.equal(index.flatten(), torch.arange(size))
            )
            found = {
                part: torch.from_numpy(self.arrays[f"map__{i}_{part}"])
                for part in ("dense", "left", "right", "buckets", "signs")
                if f"map__{i}_{part}" in self.arrays
            }
            views.append((name, None if whole else index.flatten(), index.shape, found))

        def call() -> torch.Tensor:
            grads = per_example()
            total = None
            for name, index, shape, found in views:
                rows = grads[name].reshape(self.batch, -1)
                if index is not None:
                    rows = rows.index_select(1, index)
                part = by_map(found, rows.reshape(self.batch, *shape))
                total = part if total is None else total + part
            return total

        return call


def main() -> None:
    parser = common.method_parser(__doc__, "reductions.npz", METHODS)
    args = parser.parse_args()
    record, methods = common.started(
        "reductions_torch", args, METHODS, lambda m: "opacus" if "opacus" in m else None
    )
    runs = Methods(common.load(args.npz), args.threads)

    def facts(method: str, timings: dict[str, Any], _: Any) -> dict[str, Any]:
        return {
            "batch": runs.batch,
            **({"noise": NOISE, "lr": LR} if "step" in method else {}),
        }

    # the DP step against the plain SGD step, every other against the
    # summed-loss gradient
    common.run_methods(
        "reductions_torch",
        runs,
        methods,
        args,
        record,
        facts,
        baseline=lambda method: "sgd_step" if "step" in method else "plain",
    )


if __name__ == "__main__":
    main()
