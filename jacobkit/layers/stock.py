"""The stock Keras layers jacobkit knows, by class name (Keras 3 and
``tf_keras`` alike), and the Keras activations that act on each element
alone. Every layer-type fact jacobkit acts on is here: a new stock layer is
one :class:`~jacobkit.layers.registry.LayerKind` more.
"""

from __future__ import annotations

from jacobkit.layers.attention import MultiHeadAttentionRule
from jacobkit.layers.conv import Conv1DRule, Conv2DRule
from jacobkit.layers.dense import DenseRule
from jacobkit.layers.depthwise import DepthwiseConv2DRule
from jacobkit.layers.einsum import EinsumDenseRule
from jacobkit.layers.embedding import EmbeddingRule, ReversibleEmbeddingRule
from jacobkit.layers.lora import DenseLoraRule, EinsumDenseLoraRule, EmbeddingLoraRule
from jacobkit.layers.normalization import (
    BatchNormalizationRule,
    GemmaRMSNormalizationRule,
    LayerNormalizationRule,
    LayerScaleRule,
    RMSNormalizationRule,
    ScaledRMSRule,
)
from jacobkit.layers.position import PositionEmbeddingRule
from jacobkit.layers.registry import LayerKind
from jacobkit.layers.separable import SeparableConv2DRule
from jacobkit.layers.vit import ViTPatchingAndEmbeddingRule

#: where keras_hub keeps the layers below
_HUB = "keras_hub.src"

#: the stock kinds; those with a rule in the order ``batch``'s refusal lists
#: them (a layer's kind is found by its class, whatever the order)
KINDS = (
    # closed forms for the batch strategy
    LayerKind("Dense", DenseRule, linear="matmul", lora=DenseLoraRule),
    LayerKind("Conv1D", Conv1DRule, linear="convolution", convolutions=("conv2d",)),
    LayerKind("Conv2D", Conv2DRule, linear="convolution", convolutions=("conv2d",)),
    LayerKind("DepthwiseConv2D", DepthwiseConv2DRule, convolutions=("depthwise",)),
    LayerKind(
        "SeparableConv2D", SeparableConv2DRule, convolutions=("depthwise", "conv2d")
    ),
    LayerKind("EinsumDense", EinsumDenseRule, lora=EinsumDenseLoraRule),
    LayerKind("MultiHeadAttention", MultiHeadAttentionRule),
    LayerKind("Embedding", EmbeddingRule, lora=EmbeddingLoraRule),
    # Keras's own (keras.layers.ReversibleEmbedding), which keras_hub's models
    # build now: keras_hub's class of that name (below) is a subclass of it,
    # or, in older keras_hub, a class of its own
    LayerKind("ReversibleEmbedding", ReversibleEmbeddingRule),
    LayerKind("LayerNormalization", LayerNormalizationRule),
    LayerKind("BatchNormalization", BatchNormalizationRule),
    LayerKind("RMSNormalization", RMSNormalizationRule),
    # other libraries' layers, by path: known once the library is imported
    LayerKind(
        f"{_HUB}.layers.modeling.position_embedding:PositionEmbedding",
        PositionEmbeddingRule,
    ),
    LayerKind(
        f"{_HUB}.layers.modeling.reversible_embedding:ReversibleEmbedding",
        ReversibleEmbeddingRule,
    ),
    LayerKind(
        f"{_HUB}.models.gemma.rms_normalization:RMSNormalization",
        GemmaRMSNormalizationRule,
    ),
    *(
        LayerKind(f"{_HUB}.models.{path}", ScaledRMSRule)
        for path in (
            "llama.llama_layernorm:LlamaLayerNorm",
            "mistral.mistral_layer_norm:MistralLayerNormalization",
            "qwen.qwen_layernorm:QwenLayerNorm",
            "qwen_moe.qwen_moe_layernorm:QwenMoeLayerNorm",
            "qwen3.qwen3_layernorm:Qwen3LayerNorm",
            "phi3.phi3_layernorm:Phi3LayerNorm",
        )
    ),
    LayerKind("keras.src.applications.convnext:LayerScale", LayerScaleRule),
    LayerKind(
        f"{_HUB}.models.vit.vit_layers:ViTPatchingAndEmbedding",
        ViTPatchingAndEmbeddingRule,
    ),
    # no closed form: facts only
    LayerKind("Conv3D", linear="convolution", convolutions=("conv3d",)),
    LayerKind("DepthwiseConv1D", convolutions=("depthwise",)),
    LayerKind("SeparableConv1D", convolutions=("depthwise", "conv2d")),
    LayerKind("Activation", elementwise=True),
    LayerKind("ReLU", elementwise=True),
    LayerKind("LeakyReLU", elementwise=True),
    LayerKind("ELU", elementwise=True),
    LayerKind("Identity", elementwise=True),
    LayerKind("Dropout", inference_identity=True),
    LayerKind("GaussianNoise", inference_identity=True),
    LayerKind("GaussianDropout", inference_identity=True),
    LayerKind("AlphaDropout", inference_identity=True),
    LayerKind("RNN", recurrent=True),
    LayerKind("Bidirectional", recurrent=True),
)

#: Keras activations that act on each element alone (``softmax``, ``glu`` and
#: friends mix the last axis and are not here).
ELEMENTWISE_ACTIVATIONS = frozenset(
    {
        "linear",
        "relu",
        "relu6",
        "elu",
        "selu",
        "celu",
        "gelu",
        "sigmoid",
        "hard_sigmoid",
        "log_sigmoid",
        "tanh",
        "hard_tanh",
        "softplus",
        "softsign",
        "swish",
        "silu",
        "hard_silu",
        "hard_swish",
        "mish",
        "exponential",
        "leaky_relu",
    }
)
#: the stock activations that TensorFlow computes as one op of the
#: pre-activation ``z`` (its type): a layer's ``z`` is that op's input in a
#: traced pass (:func:`jacobkit.keras.calls.pre_activation`). Read from the
#: traced Keras 3 layers (gelu, silu, mish and hard_sigmoid are several ops)
ONE_OP_ACTIVATIONS = {
    "relu": "Relu",
    "relu6": "Relu6",
    "elu": "Elu",
    "selu": "Selu",
    "sigmoid": "Sigmoid",
    "tanh": "Tanh",
    "softplus": "Softplus",
    "softsign": "Softsign",
    "exponential": "Exp",
    "leaky_relu": "LeakyRelu",
}
