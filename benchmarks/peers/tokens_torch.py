"""PyTorch on the token-attribution benchmark: captum's gradient attributions
of a generated continuation (``LLMGradientAttribution`` and its
``LayerGradientXActivation`` per generated token) and a plain
``torch.autograd`` loop, on the GPT-2 that ``export_gpt2.py`` wrote, run as
Hugging Face's ``GPT2LMHeadModel``, checked against jacobkit's
``explain.generate_and_attribute`` scores in that file.

Runs in its own virtual environment (see README.md), with ``captum`` and
``transformers``, pinned to one core with one PyTorch thread (it refuses to
run otherwise; ``footing.py``); prints one JSON line per method:

    python tokens_torch.py --npz gpt2.npz --method captum_gradient_x_input

The model: ``GPT2LMHeadModel`` of the file's shape (``activation_function=
"gelu_new"``, keras_hub's ``gelu_approximate``; its layer-norm epsilon;
dropout 0; ``lm_head`` tied to ``transformer.wte``), loaded with the file's
weights; its logits on the file's 96 tokens are checked against the Keras
model's (``logits_err``; after the first method's timing, which it would
warm up).

Every method attributes each of the 32 generated tokens (the log-probability
that its position gives it, softmax over the vocabulary) to the token
embeddings (``transformer.wte``'s output) of every earlier token, as captum
does (pytorch/captum#1201): one forward pass on the prefix (the prompt and
the tokens generated before it) and one backward pass per generated token.
jacobkit takes all 32 rows from one pass over the whole sequence (causal
masking): the gradients at the earlier tokens are the same, and its entries
at later tokens are 0. Methods (``--method``, repeatable; default all):

- ``plain_step``: one plain training step on the 96 tokens (the summed
  next-token loss's gradient over every weight): the baseline every other
  method is divided by (``--paired-rounds``: also paired with it in one
  process), as jacobkit's side divides by TensorFlow's;
- ``torch_batched``: the peer, jacobkit's work in PyTorch: one forward pass
  over the whole sequence and the 32 targets' backward passes batched by
  ``vmap`` (see :meth:`Methods.torch_batched`); the loops below are extras;

- ``captum_gradient``: ``LayerGradientXActivation(multiply_by_inputs=False)``
  on ``transformer.wte`` (the plain gradient), its forward function captum's
  ``LLMGradientAttribution``'s (the prefix's last log-probability of the
  target token), called per generated token; the L2 norm over the embedding
  (jacobkit's ``"gradient"``);
- ``captum_gradient_x_input``: the same with ``multiply_by_inputs=True``
  (gradient x embedding), summed over the embedding (jacobkit's
  ``"gradient_x_input"``);
- ``captum_llm_gradient_x_input``: captum's ``LLMGradientAttribution``
  itself, wrapping ``LayerGradientXActivation`` on ``transformer.wte``, on a
  ``TextTokenInput`` of the prompt (an id-per-word tokenizer made here: the
  model has no text) with the generated tokens as ``target``. captum keeps
  only the prompt's columns (it computes the earlier generated tokens'
  gradients too, then cuts them), so its ``(32, 64)`` ``token_attr`` is
  checked against jacobkit's first 64 columns. (Its ``"gradient"`` would sum
  the plain gradient over the embedding, not take its norm: no counterpart);
- ``torch_loop``: the same loop with ``torch.autograd.grad`` and no captum
  (the model run from ``inputs_embeds``): both the gradient's norm and
  gradient x embedding, checked against both of jacobkit's.

Each method's last timed result is checked (the largest absolute difference
over the largest magnitude; one above ``--tolerance`` ends the run with an
error and no line for that method). ``scores_per_s`` is the generated tokens
attributed (32) over ``steady_s``; generation is not timed (the tokens come
from the file).

Run each method in a fresh process where first calls compare: the methods
share PyTorch's first-call setup.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import common
import numpy as np
import torch
from common import Run
from protocol import relative_error

METHODS = (
    "plain_step",
    "torch_batched",
    "captum_gradient",
    "captum_gradient_x_input",
    "captum_llm_gradient_x_input",
    "torch_loop",
)


def build(arrays: dict[str, np.ndarray]) -> Any:
    """``GPT2LMHeadModel`` of the file's shape, with its weights, in eval
    mode."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=int(arrays["vocabulary_size"]),
        n_positions=int(arrays["max_sequence_length"]),
        n_embd=int(arrays["hidden_dim"]),
        n_layer=int(arrays["num_layers"]),
        n_head=int(arrays["num_heads"]),
        n_inner=int(arrays["intermediate_dim"]),
        activation_function="gelu_new",  # keras_hub's gelu_approximate (tanh)
        layer_norm_epsilon=float(arrays["layer_norm_epsilon"]),
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        tie_word_embeddings=True,
        bos_token_id=None,  # GPT-2's 50256 is outside this vocabulary
        eos_token_id=None,
        # attention as matmuls and a softmax: vmap batches their backward
        # passes, while SDPA's CPU kernel has no batching rule and vmap
        # falls back to a loop over the rows (torch 2.13; the loops' times
        # are the same either way)
        attn_implementation="eager",
    )
    model = GPT2LMHeadModel(config)
    names = [k for k in arrays if k.startswith("transformer.")]
    weights = {k: torch.from_numpy(arrays[k]) for k in names}
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise SystemExit(
            f"tokens_torch: weights missing {missing}, unexpected {unexpected}"
        )
    if model.lm_head.weight.data_ptr() != model.transformer.wte.weight.data_ptr():
        raise SystemExit("tokens_torch: lm_head is not tied to transformer.wte")
    model.eval()
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    return model


def error(got: Any, want: np.ndarray) -> float:
    """The largest absolute difference over the largest magnitude."""
    return relative_error(got, want, "tokens_torch")


class IdTokenizer:
    """The least tokenizer captum's ``TextTokenInput`` and
    ``LLMGradientAttribution`` take: the text ``"t12 t7"`` is the token ids
    ``[12, 7]``."""

    def encode(
        self,
        text: str,
        add_special_tokens: bool = True,
        return_tensors: str | None = None,
    ) -> Any:
        ids = [int(word[1:]) for word in text.split()]
        return torch.tensor([ids]) if return_tensors == "pt" else ids

    def decode(self, token_ids: Any) -> str:
        ids = torch.as_tensor(token_ids).reshape(-1).tolist()
        return " ".join(f"t{i}" for i in ids)

    def convert_ids_to_tokens(self, token_ids: Any) -> Any:
        if isinstance(token_ids, int):
            return f"t{token_ids}"
        return [f"t{i}" for i in token_ids]

    def convert_tokens_to_ids(self, tokens: Any) -> Any:
        if isinstance(tokens, str):
            return int(tokens[1:])
        return [int(t[1:]) for t in tokens]

    def __call__(
        self, text: str, return_offsets_mapping: bool = False, **kwargs: Any
    ) -> dict[str, Any]:
        ids, offsets, start = [], [], 0
        for word in text.split(" "):
            ids.append(int(word[1:]))
            offsets.append((start, start + len(word)))
            start += len(word) + 1
        found: dict[str, Any] = {"input_ids": ids}
        if return_offsets_mapping:
            found["offset_mapping"] = offsets
        return found


class Methods:
    """Each method's call (what is timed) and its check of the result."""

    def __init__(self, arrays: dict[str, np.ndarray]) -> None:
        self.arrays = arrays
        self.model = build(arrays)
        self.tokens = torch.from_numpy(arrays["tokens"].astype("int64"))  # (1, T)
        self.prompt = arrays["prompt"].shape[1]
        self.length = self.tokens.shape[1]
        self.new = self.length - self.prompt

    def logits_err(self) -> float:
        with torch.no_grad():
            logits = self.model(self.tokens).logits
        return error(logits.numpy(), self.arrays["logits"])

    def scores(self, rows: list[torch.Tensor]) -> np.ndarray:
        """Row ``k`` (``prompt + k`` tokens long) padded with zeros to the
        whole sequence: ``(1, new, T)``, as jacobkit's."""
        found = np.zeros((1, self.new, self.length))
        for k, row in enumerate(rows):
            found[0, k, : row.shape[-1]] = row.reshape(-1).double().numpy()
        return found

    def check(self, name: str) -> Callable[[Any], dict[str, float]]:
        want = self.arrays[f"scores_{name}"]
        return lambda result: {"scores_err": error(self.scores(result), want)}

    def log_prob(self, k: int) -> Callable[[torch.Tensor], torch.Tensor]:
        """captum's ``LLMGradientAttribution`` forward function for generated
        token ``k``: the prefix's last position's log-probability of it."""
        target = int(self.tokens[0, self.prompt + k])

        def forward(ids: torch.Tensor) -> torch.Tensor:
            logits = self.model(ids).logits[:, -1]
            return torch.log_softmax(logits, dim=-1)[:, target]

        return forward

    def captum_layer(self, multiply: bool) -> Callable[[], list[torch.Tensor]]:
        from captum.attr import LayerGradientXActivation

        layer = self.model.transformer.wte
        methods = [
            LayerGradientXActivation(
                self.log_prob(k), layer, multiply_by_inputs=multiply
            )
            for k in range(self.new)
        ]

        def call() -> list[torch.Tensor]:
            rows = []
            for k, method in enumerate(methods):
                prefix = self.tokens[:, : self.prompt + k]
                attr = method.attribute(prefix).detach()  # (1, prefix, D)
                rows.append(attr.sum(-1) if multiply else attr.norm(dim=-1))
            return rows

        return call

    def captum_gradient(self) -> Run:
        return self.captum_layer(False), self.check("gradient")

    def captum_gradient_x_input(self) -> Run:
        return self.captum_layer(True), self.check("gradient_x_input")

    def captum_llm_gradient_x_input(self) -> Run:
        from captum.attr import (
            LayerGradientXActivation,
            LLMGradientAttribution,
            TextTokenInput,
        )

        tokenizer: Any = IdTokenizer()  # captum's TokenizerLike, in part
        method = LLMGradientAttribution(
            LayerGradientXActivation(self.model, self.model.transformer.wte),
            tokenizer,
        )
        prompt = tokenizer.decode(self.tokens[0, : self.prompt])
        target = self.tokens[0, self.prompt :]

        def call() -> torch.Tensor:
            text = TextTokenInput(prompt, tokenizer)
            result = method.attribute(text, target=target)
            return result.token_attr.detach()  # (new, prompt)

        def check(result: torch.Tensor) -> dict[str, float]:
            want = self.arrays["scores_gradient_x_input"][0, :, : self.prompt]
            return {"scores_err": error(result.numpy(), want)}

        return call, check

    def plain_step(self) -> Run:
        """One plain training step of the model on the same 96 tokens: the
        gradient of the summed next-token loss over every parameter (one
        forward and one backward pass): the baseline each method here is
        divided by, as jacobkit's side divides by TensorFlow's."""
        model = build(self.arrays)
        for parameter in model.parameters():
            parameter.requires_grad_(True)
        params = [p for p in model.parameters() if p.requires_grad]
        inputs, labels = self.tokens[:, :-1], self.tokens[:, 1:]

        def call() -> tuple[torch.Tensor, ...]:
            logits = model(inputs).logits
            loss = torch.nn.functional.cross_entropy(
                logits.flatten(0, 1), labels.reshape(-1), reduction="sum"
            )
            return torch.autograd.grad(loss, params)

        return call, lambda result: {}

    def torch_batched(self) -> Run:
        """jacobkit's work, batched in PyTorch: one forward pass over the
        whole sequence (causal masking), the 32 generated tokens'
        log-probabilities at the positions before them, and one batched
        backward pass of their 32 one-hot cotangents to the token embeddings
        (``torch.func.vjp``, its backward function ``vmap``'d over the
        cotangents; ``torch.autograd.grad(..., is_grads_batched=True)`` took
        1.07-1.18x as long): ``(32, 1, T, D)``, the gradient's norm and
        gradient x embedding."""
        model = self.model
        embedded = model.transformer.wte(self.tokens).detach()  # (1, T, D)
        positions = torch.arange(self.prompt - 1, self.prompt - 1 + self.new)
        targets = self.tokens[0, positions + 1]
        eye = torch.eye(self.new)

        rows = torch.arange(self.new)

        def log_p(inputs: torch.Tensor) -> torch.Tensor:
            logits = model(inputs_embeds=inputs).logits[0, positions]  # (new, V)
            return torch.log_softmax(logits, dim=-1)[rows, targets]

        def call() -> tuple[torch.Tensor, torch.Tensor]:
            _, backward = torch.func.vjp(log_p, embedded)
            (grads,) = torch.func.vmap(backward)(eye)  # (new, 1, T, D)
            grads = grads[:, 0]
            return grads.norm(dim=-1)[None], (grads * embedded).sum(-1)[None]

        def check(result: Any) -> dict[str, float]:
            return {
                "scores_err": error(result[0].numpy(), self.arrays["scores_gradient"]),
                "scores_x_input_err": error(
                    result[1].numpy(), self.arrays["scores_gradient_x_input"]
                ),
            }

        return call, check

    def torch_loop(self) -> Run:
        model = self.model
        embedded = model.transformer.wte(self.tokens)  # (1, T, D)

        def call() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
            norms, products = [], []
            for k in range(self.new):
                end = self.prompt + k
                inputs = embedded[:, :end].detach().requires_grad_(True)
                logits = model(inputs_embeds=inputs).logits[:, -1]
                log_p = torch.log_softmax(logits, dim=-1)[0, self.tokens[0, end]]
                (gradient,) = torch.autograd.grad(log_p, inputs)
                norms.append(gradient.norm(dim=-1))
                products.append((gradient * inputs.detach()).sum(-1))
            return norms, products

        def check(result: Any) -> dict[str, float]:
            return {
                "scores_err": error(
                    self.scores(result[0]), self.arrays["scores_gradient"]
                ),
                "scores_x_input_err": error(
                    self.scores(result[1]), self.arrays["scores_gradient_x_input"]
                ),
            }

        return call, check


def main() -> None:
    parser = common.method_parser(__doc__, "gpt2.npz", METHODS)
    args = parser.parse_args()
    record, methods = common.started(
        "tokens_torch", args, METHODS, lambda m: "captum" if "captum" in m else None
    )
    runs = Methods(common.load(args.npz))
    found: dict[str, float] = {}

    def logits() -> None:
        """The model's logits against the Keras model's, after the first
        method's timing (it would warm that up)."""
        found["logits_err"] = runs.logits_err()
        print(f"tokens_torch: logits_err {found['logits_err']:.2e}", file=sys.stderr)
        if not found["logits_err"] <= args.tolerance:
            raise SystemExit(
                f"tokens_torch: GPT2LMHeadModel's logits differ from the "
                f"Keras model's in {args.npz} (error {found['logits_err']:.2e})"
            )

    def facts(method: str, timings: dict[str, Any], _: Any) -> dict[str, Any]:
        return {
            "prompt": runs.prompt,
            "new_tokens": runs.new,
            "logits_err": found["logits_err"],
            "scores_per_s": runs.new / timings["steady_s"],
        }

    common.run_methods(
        "tokens_torch", runs, methods, args, record, facts, after_first=logits
    )


if __name__ == "__main__":
    main()
