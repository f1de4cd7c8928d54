"""DP-LoRA: fine-tune a small GPT-2's LoRA factors with DP-SGD by ``fit``.

A tiny keras_hub ``GPT2CausalLM`` (random init, no downloads) is first
"pretrained" without privacy on a generated corpus (a small English-like
grammar whose objects are drawn at random); then ``backbone.enable_lora``
adds low-rank factors to its attention's query and value projections and
only those are fine-tuned, privately, by ``jk.privacy.make_private`` and
``fit`` (compiled, no ``run_eagerly``) on a second generated corpus, the
"private" one, where each verb takes its own kind of object (``the cat
eats the fish``, ``the dog chases the ball``). The same LoRA fine-tuning
without privacy runs beside it, on a copy of the pretrained model.

Printed: each epoch's loss (train, held out), epsilon (RDP and PLD at
``delta``), held-out next-token accuracy, the time per step of both
fine-tunings; saved: the loss curves as a PNG. Run from the repository's
root (``docs/dp-lora.md`` shows the output)::

    python examples/dp_lora.py                 # the default run, ~80 s
    python examples/dp_lora.py --quick         # a smoke run, seconds

Needs keras_hub and dp-accounting (``pip install 'jacobkit[privacy]'
keras-hub``); matplotlib for the plot (skipped without it).
"""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from jacobkit import runtime

# TensorFlow's C++ start-up lines (oneDNN, CUDA notices) stay off the output
runtime.start_tensorflow_quietly()

import keras  # noqa: E402 - after TensorFlow started quietly
import numpy as np  # noqa: E402

import jacobkit as jk  # noqa: E402

# dp-accounting's RDP accountant logs each order it leaves out (by absl)
logging.getLogger("absl").setLevel(logging.ERROR)

#: the padding token: inputs after a sentence's end, and targets to ignore
PAD = 0
NOUNS = ("cat", "dog", "bird", "fish", "ball", "seed", "mouse", "bone")
ADJECTIVES = ("big", "small", "red", "old")
#: the fine-tuning corpus's rules: each subject's verb (below), and each
#: verb's objects
VERB_OF = {
    "cat": "eats",
    "bird": "eats",
    "dog": "chases",
    "mouse": "finds",
    "fish": "sees",
}
OBJECTS = {
    "eats": ("fish", "seed"),
    "chases": ("ball", "mouse"),
    "finds": ("bone",),
    "sees": ("bird", "cat"),
}
VOCABULARY = ("<pad>", "the", ".", *NOUNS, *ADJECTIVES, *OBJECTS)
WORD = {word: i for i, word in enumerate(VOCABULARY)}


def per_example_loss(y_true: Any, y_pred: Any) -> Any:
    """Each sequence's mean next-token cross-entropy over its real tokens.

    Args:
        y_true: the next tokens, shape ``(B, T)``, ``PAD`` where there is
            none (those positions are left out).
        y_pred: the logits, shape ``(B, T, V)``.

    Returns:
        shape ``(B,)``: one row per example, as ``make_private`` needs.
    """
    tokens = keras.losses.sparse_categorical_crossentropy(
        y_true, y_pred, from_logits=True
    )
    mask = keras.ops.cast(keras.ops.not_equal(y_true, PAD), tokens.dtype)
    return keras.ops.sum(tokens * mask, -1) / keras.ops.maximum(
        keras.ops.sum(mask, -1), 1.0
    )


def sentences(count: int, rng: np.random.Generator, ruled: bool) -> list[list[str]]:
    """``count`` sentences ``the [adj] noun verb the [adj] noun .``; with
    ``ruled`` the subject is one of ``VERB_OF``'s and its verb that one, the
    object one of the verb's (``OBJECTS``); else any noun and verb."""
    verbs = list(OBJECTS)
    subjects = list(VERB_OF) if ruled else NOUNS
    found = []
    for _ in range(count):
        subject = subjects[rng.integers(len(subjects))]
        verb = VERB_OF[subject] if ruled else verbs[rng.integers(len(verbs))]
        kinds = OBJECTS[verb] if ruled else NOUNS
        words = ["the"]
        if rng.random() < 0.5:
            words.append(ADJECTIVES[rng.integers(len(ADJECTIVES))])
        words += [subject, verb, "the"]
        if rng.random() < 0.5:
            words.append(ADJECTIVES[rng.integers(len(ADJECTIVES))])
        words += [kinds[rng.integers(len(kinds))], "."]
        found.append(words)
    return found


def encode(text: list[list[str]], length: int) -> tuple[dict[str, np.ndarray], Any]:
    """Sentences as the causal LM's ``(x, y)``: ``x`` token ids and padding
    mask, shape ``(N, length)``; ``y`` the next token at each position,
    ``PAD`` after the last."""
    ids = np.full((len(text), length + 1), PAD, np.int32)
    for i, words in enumerate(text):
        ids[i, : len(words)] = [WORD[w] for w in words]
    x = {
        "token_ids": ids[:, :-1],
        "padding_mask": (ids[:, :-1] != PAD).astype(np.int32),
    }
    return x, ids[:, 1:]


@dataclass(frozen=True)
class Settings:
    """The run's settings (the command line's).

    Attributes:
        layers, hidden, rank: GPT-2's transformer layers, width, LoRA rank.
        pretrain_examples, pretrain_epochs: the non-private pretraining's.
        examples: the private corpus's training examples ``N``.
        batch: the expected batch size ``q * N``.
        epochs: fine-tuning epochs (``1 / q`` steps each).
        clip, noise, delta: ``C``, ``sigma``, ``delta``.
        learning_rate: Adam's, both fine-tunings.
        seed: weights, corpora, sampling and noise.
        one_size: pad every Poisson draw to the sampler's largest size (one
            trace of the step; each step pays for the largest batch).
        timing_rounds: paired rounds timing a DP step against a plain one
            (0: not timed).
        plot: where the loss curves go (``None``: not drawn).
    """

    layers: int = 2
    hidden: int = 32
    rank: int = 4
    pretrain_examples: int = 2048
    pretrain_epochs: int = 3
    examples: int = 4096
    batch: int = 128
    epochs: int = 6
    clip: float = 0.1
    noise: float = 0.8
    delta: float = 1e-5
    learning_rate: float = 5e-2
    seed: int = 0
    one_size: bool = True
    timing_rounds: int = 40
    plot: Path | None = None


#: the longest sentence (10 words) and its next-token targets
LENGTH = 10


def pretrained(settings: Settings) -> tuple[Any, dict[str, np.ndarray]]:
    """A tiny ``GPT2CausalLM`` trained without privacy on the unruled
    corpus; returned with a copy of its weights by path."""
    import keras_hub

    keras.utils.set_random_seed(settings.seed)
    model = keras_hub.models.GPT2CausalLM(gpt2(settings), preprocessor=None)
    rng = np.random.default_rng(settings.seed)
    x, y = encode(sentences(settings.pretrain_examples, rng, False), LENGTH)
    model.compile(keras.optimizers.Adam(5e-3), per_example_loss)
    model.fit(x, y, batch_size=64, epochs=settings.pretrain_epochs, verbose=0)
    return model, {w.path: w.numpy().copy() for w in model.weights}


def gpt2(settings: Settings) -> Any:
    """The tiny ``GPT2Backbone`` (no dropout: see ``docs/dp-lora.md``)."""
    import keras_hub

    return keras_hub.models.GPT2Backbone(
        vocabulary_size=len(VOCABULARY),
        num_layers=settings.layers,
        num_heads=2,
        hidden_dim=settings.hidden,
        intermediate_dim=2 * settings.hidden,
        dropout=0.0,
        max_sequence_length=LENGTH,
    )


def with_lora(model: Any, settings: Settings) -> Any:
    """``model``'s backbone with LoRA factors of ``settings.rank`` (only
    they stay trainable), drawn from ``settings.seed``."""
    keras.utils.set_random_seed(settings.seed + 1)
    model.backbone.enable_lora(settings.rank)
    for variable in model.trainable_variables:
        # enable_lora leaves the projections' biases trainable: frozen too
        if "lora_kernel" not in variable.path:
            variable.trainable = False
    return model


def logits(model: Any, x: dict[str, np.ndarray]) -> np.ndarray:
    """``model``'s logits on ``x``, shape ``(N, T, V)``, by calling it (not
    ``predict``, whose compiled function, once traced, would not see the
    LoRA factors ``enable_lora`` adds after it)."""
    return keras.ops.convert_to_numpy(model(x, training=False))


def accuracy(model: Any, x: dict[str, np.ndarray], y: np.ndarray) -> float:
    """Next-token accuracy over the real (non-``PAD``) targets."""
    predicted = np.argmax(logits(model, x), -1)
    real = y != PAD
    return float(np.mean(predicted[real] == y[real]))


def held_out_loss(model: Any, x: dict[str, np.ndarray], y: np.ndarray) -> float:
    """The mean of :func:`per_example_loss` over a held-out set."""
    rows = per_example_loss(y, logits(model, x))
    return float(np.mean(keras.ops.convert_to_numpy(rows)))


class Record(keras.callbacks.Callback):
    """Per epoch: the held-out loss and accuracy of ``model`` (the user's
    model, not the private wrapper); per step: its wall time (s).

    Args:
        model: the model evaluated.
        x, y: the held-out set.
    """

    def __init__(self, model: Any, x: dict[str, np.ndarray], y: np.ndarray) -> None:
        super().__init__()
        self.evaluated, self.x, self.y = model, x, y
        self.losses: list[float] = []
        self.accuracies: list[float] = []
        self.step_times: list[float] = []
        self.started = 0.0

    def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
        self.started = time.perf_counter()

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        self.step_times.append(time.perf_counter() - self.started)

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self.losses.append(held_out_loss(self.evaluated, self.x, self.y))
        self.accuracies.append(accuracy(self.evaluated, self.x, self.y))


@dataclass(frozen=True)
class Run:
    """One fine-tuning's record: ``train`` losses per epoch, the ``record``
    (held-out losses, accuracies, step times), ``epsilon`` per epoch (RDP,
    PLD; private only), the model and the (DP) steps it took."""

    train: list[float]
    record: Record
    epsilon: list[tuple[float, float]]
    model: Any
    steps: int


def fine_tune_private(
    model: Any, data: tuple[Any, Any], test: tuple[Any, Any], settings: Settings
) -> Run:
    """DP-SGD on ``model``'s LoRA factors by ``make_private`` and ``fit``."""
    n = len(data[1])
    q = settings.batch / n
    sampler = jk.privacy.PoissonSampler(data, sampling_rate=q, seed=settings.seed)
    if settings.one_size:
        sampler = jk.privacy.PoissonSampler(
            data, sampling_rate=q, seed=settings.seed, sizes=sampler.sizes[-1:]
        )
    private = jk.privacy.make_private(
        model,
        l2_norm_clip=settings.clip,
        noise_multiplier=settings.noise,
        sampling_rate=q,
        num_examples=n,
        seed=settings.seed,
    )
    private.compile(keras.optimizers.Adam(settings.learning_rate), per_example_loss)
    record = Record(model, *test)
    history = private.fit(
        sampler,
        epochs=settings.epochs,
        verbose=0,
        callbacks=[jk.privacy.EpsilonCallback(settings.delta), record],
    )
    steps = len(sampler)
    pld = [
        jk.privacy.epsilon(q, settings.noise, steps * e, settings.delta, "pld")
        for e in range(1, settings.epochs + 1)
    ]
    eps = list(zip(history.history["epsilon"], pld, strict=True))
    taken = int(private.dp_steps.numpy())
    return Run(history.history["loss"], record, eps, model, taken)


def fine_tune_plain(
    model: Any, data: tuple[Any, Any], test: tuple[Any, Any], settings: Settings
) -> Run:
    """The same LoRA fine-tuning without privacy: shuffled batches of the
    expected batch size, the batch's mean loss, the same Adam."""
    model.compile(keras.optimizers.Adam(settings.learning_rate), per_example_loss)
    record = Record(model, *test)
    history = model.fit(
        *data,
        batch_size=settings.batch,
        epochs=settings.epochs,
        steps_per_epoch=round(len(data[1]) / settings.batch),
        verbose=0,
        callbacks=[record],
    )
    return Run(history.history["loss"], record, [], model, len(record.step_times))


def plot(private: Run, plain: Run, before: tuple[float, float], path: Path) -> None:
    """The losses (train, held out) and the held-out accuracy per epoch of
    both runs (epoch 0: the pretrained model), as a PNG."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ModuleNotFoundError:
        print(f"(no matplotlib: {path} not drawn)")
        return
    epochs = np.arange(len(private.train) + 1)
    figure, (loss, accuracy) = plt.subplots(1, 2, figsize=(9, 3.5))
    for run, name, color in ((private, "DP-SGD", "C0"), (plain, "non-private", "C1")):
        loss.plot(epochs[1:], run.train, "--", color=color, label=f"{name}, train")
        held_out = [before[0], *run.record.losses]
        loss.plot(epochs, held_out, "-o", color=color, label=f"{name}, held out")
        accuracies = [before[1], *run.record.accuracies]
        accuracy.plot(epochs, accuracies, "-o", color=color, label=name)
    loss.set_ylabel("mean next-token loss")
    accuracy.set_ylabel("held-out next-token accuracy")
    for axes in (loss, accuracy):
        axes.set_xlabel("epoch (0: pretrained)")
        axes.set_xticks(epochs)
        axes.legend()
    figure.suptitle("LoRA fine-tuning of a tiny GPT-2")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    print(f"loss curves: {path}")


def report(
    private: Run, plain: Run, before: tuple[float, float], settings: Settings
) -> None:
    """The per-epoch table and the time per step."""
    print(
        "epoch  DP train  DP held-out  DP acc  eps RDP  eps PLD"
        "  plain train  plain held-out  plain acc"
    )
    for e in range(settings.epochs):
        rdp, pld = private.epsilon[e]
        print(
            f"{e + 1:5d}  {private.train[e]:8.3f}  {private.record.losses[e]:11.3f}"
            f"  {private.record.accuracies[e]:6.3f}  {rdp:7.2f}  {pld:7.2f}"
            f"  {plain.train[e]:11.3f}  {plain.record.losses[e]:14.3f}"
            f"  {plain.record.accuracies[e]:9.3f}"
        )
    print(
        f"before fine-tuning: held-out loss {before[0]:.3f}, accuracy {before[1]:.3f}"
    )
    print(
        f"held-out next-token accuracy: {before[1]:.3f} before fine-tuning, "
        f"{private.record.accuracies[-1]:.3f} after DP-SGD, "
        f"{plain.record.accuracies[-1]:.3f} after non-private"
    )
    dp_ms = 1e3 * float(np.median(private.record.step_times))
    plain_ms = 1e3 * float(np.median(plain.record.step_times))
    print(
        f"time per step in fit (medians of {len(private.record.step_times)} and "
        f"{len(plain.record.step_times)}, one run after the other): DP-SGD "
        f"{dp_ms:.1f} ms, non-private {plain_ms:.1f} ms"
    )
    first = len(private.record.step_times) // settings.epochs
    print(
        "the first epoch's DP steps, the step's tracing included: "
        f"{sum(private.record.step_times[:first]):.1f} s"
    )


def time_steps(
    weights: dict[str, np.ndarray], data: tuple[Any, Any], settings: Settings
) -> None:
    """A DP step against a plain LoRA step, paired: each on a fresh LoRA
    copy of the pretrained model, compiled as ``fit`` runs it
    (``train_on_batch``: the DP one on a Poisson draw padded as the run
    pads it, the plain one on a batch of the expected size); every round
    times one of each, the order alternating. Printed: the medians and the
    median of the per-round ratios with its bootstrap interval."""
    import keras_hub

    from jacobkit.bench import stats

    def copy() -> Any:
        model = keras_hub.models.GPT2CausalLM(gpt2(settings), preprocessor=None)
        model.set_weights(list(weights.values()))
        return with_lora(model, settings)

    q = settings.batch / len(data[1])
    sampler = jk.privacy.PoissonSampler(data, sampling_rate=q, seed=settings.seed)
    if settings.one_size:
        sampler = jk.privacy.PoissonSampler(
            data, sampling_rate=q, seed=settings.seed, sizes=sampler.sizes[-1:]
        )
    private = jk.privacy.make_private(
        copy(),
        l2_norm_clip=settings.clip,
        noise_multiplier=settings.noise,
        sampling_rate=q,
        num_examples=len(data[1]),
    )
    private.compile(keras.optimizers.Adam(settings.learning_rate), per_example_loss)
    private.prepare(sampler)
    x, y, w = sampler[0]
    plain = copy()
    plain.compile(keras.optimizers.Adam(settings.learning_rate), per_example_loss)
    take = slice(0, settings.batch)
    plain_batch = ({k: v[take] for k, v in data[0].items()}, data[1][take])
    steps = {
        f"DP-SGD (padded batch of {len(w)})": lambda: private.train_on_batch(
            x, y, sample_weight=w
        ),
        f"non-private (batch of {settings.batch})": lambda: plain.train_on_batch(
            *plain_batch
        ),
    }
    times: dict[str, list[float]] = {name: [] for name in steps}
    names = list(steps)
    for round_ in range(-3, settings.timing_rounds):  # 3 to warm up
        for name in names if round_ % 2 else names[::-1]:
            start = time.perf_counter()
            steps[name]()
            if round_ >= 0:
                times[name].append(time.perf_counter() - start)
    dp, base = (times[name] for name in names)
    ratio = stats.ratios([d / p for d, p in zip(dp, base, strict=True)])
    print(
        f"time per step, paired ({settings.timing_rounds} rounds): "
        f"{names[0]} {1e3 * np.median(dp):.1f} ms, {names[1]} "
        f"{1e3 * np.median(base):.1f} ms: {ratio.median:.2f}x "
        f"{stats.interval_text(ratio.low, ratio.high)}"
    )


#: ``--quick``'s settings: a smoke run of seconds (one trace of the DP step)
QUICK = {
    "pretrain_examples": 1024,
    "examples": 1024,
    "epochs": 3,
    "timing_rounds": 0,
    "plot": None,
}


def parse_settings(argv: Sequence[str] | None = None) -> Settings:
    """The command line's :class:`Settings` (``--quick``: :data:`QUICK`'s
    sizes, the other flags as given)."""
    default = Settings()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run")
    parser.add_argument("--layers", type=int, default=default.layers)
    parser.add_argument("--hidden", type=int, default=default.hidden)
    parser.add_argument("--rank", type=int, default=default.rank)
    parser.add_argument(
        "--pretrain-examples", type=int, default=default.pretrain_examples
    )
    parser.add_argument("--examples", type=int, default=default.examples)
    parser.add_argument("--batch", type=int, default=default.batch, help="q*N")
    parser.add_argument("--epochs", type=int, default=default.epochs)
    parser.add_argument("--pretrain-epochs", type=int, default=default.pretrain_epochs)
    parser.add_argument("--clip", type=float, default=default.clip, help="C")
    parser.add_argument("--noise", type=float, default=default.noise, help="sigma")
    parser.add_argument("--lr", type=float, default=default.learning_rate)
    parser.add_argument("--seed", type=int, default=default.seed)
    parser.add_argument(
        "--all-sizes",
        action="store_true",
        help="pad each draw to the sampler's next size (a trace per size), "
        "not all to the largest",
    )
    parser.add_argument("--timing-rounds", type=int, default=default.timing_rounds)
    parser.add_argument("--plot", type=Path, default=Path("dp_lora.png"))
    args = parser.parse_args(argv)
    settings = Settings(
        layers=args.layers,
        hidden=args.hidden,
        rank=args.rank,
        pretrain_examples=args.pretrain_examples,
        pretrain_epochs=args.pretrain_epochs,
        examples=args.examples,
        batch=args.batch,
        epochs=args.epochs,
        clip=args.clip,
        noise=args.noise,
        learning_rate=args.lr,
        seed=args.seed,
        one_size=not args.all_sizes,
        timing_rounds=args.timing_rounds,
        plot=args.plot,
    )
    return replace(settings, **QUICK) if args.quick else settings


@dataclass(frozen=True)
class Outcome:
    """What :func:`run` returns (for the test): both runs, the accuracy
    before fine-tuning (held-out loss, accuracy), the pretrained weights, the
    settings."""

    private: Run
    plain: Run
    before: tuple[float, float]
    pretrained: dict[str, np.ndarray]
    settings: Settings


def run(settings: Settings) -> Outcome:
    """Pretrain, then fine-tune LoRA privately and not; print the report."""
    import keras_hub

    start = time.perf_counter()
    base, weights = pretrained(settings)
    rng = np.random.default_rng(settings.seed + 2)
    data = encode(sentences(settings.examples, rng, True), LENGTH)
    test = encode(sentences(512, rng, True), LENGTH)
    before = held_out_loss(base, *test), accuracy(base, *test)
    print(
        f"GPT-2: {settings.layers} layers, width {settings.hidden}, vocabulary "
        f"{len(VOCABULARY)}, {base.count_params():,} weights; pretrained on "
        f"{settings.pretrain_examples} unruled sentences in "
        f"{time.perf_counter() - start:.0f} s"
    )
    private = fine_tune_private(with_lora(base, settings), data, test, settings)
    twin = keras_hub.models.GPT2CausalLM(gpt2(settings), preprocessor=None)
    twin.set_weights(list(weights.values()))
    plain = fine_tune_plain(with_lora(twin, settings), data, test, settings)
    trained = sum(int(np.prod(v.shape)) for v in private.model.trainable_variables)
    q = settings.batch / settings.examples
    print(
        f"LoRA rank {settings.rank}: {trained:,} trained weights; DP-SGD with "
        f"C={settings.clip}, sigma={settings.noise}, q={q:.4f} (expected batch "
        f"{settings.batch} of N={settings.examples}), delta={settings.delta:g}"
    )
    report(private, plain, before, settings)
    if settings.timing_rounds:
        time_steps(weights, data, settings)
    if settings.plot is not None:
        plot(private, plain, before, settings.plot)
    return Outcome(private, plain, before, weights, settings)


def main(argv: Sequence[str] | None = None) -> Outcome:
    """The command line."""
    return run(parse_settings(argv))


if __name__ == "__main__":
    main()
