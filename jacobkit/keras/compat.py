"""Keras 3, ``tf_keras`` or a plain ``tf.Module``: what kind of model or layer
an object is, the ``tf.Variable`` behind a Keras variable, every layer a
model holds, and each attribute of a Keras layer, model or variable that
jacobkit reads where not every object has it (a layer's compute dtype,
activation, LoRA/quantization, a variable's path, a model's declared inputs
and outputs). The one place jacobkit probes Keras objects: code outside
``jacobkit.keras`` calls these functions instead of ``getattr``/``hasattr``.
How jacobkit's compiled functions are traced and called: AutoGraph where a
model's code needs it (:func:`needs_autograph`), a lighter graph optimizer
(:class:`LightOptimized`).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import tensorflow as tf

from jacobkit import runtime


def keras3() -> ModuleType | None:
    """The ``keras`` package if it is Keras 3, else ``None``."""
    try:
        import keras

        return keras if keras.__version__.startswith("3") else None
    except ImportError:  # pragma: no cover - keras ships with tensorflow
        return None


def tf_keras() -> ModuleType | None:
    """The ``tf_keras`` package (Keras 2) where it is imported, else ``None``.

    Nothing can be a ``tf_keras`` object before ``tf_keras`` is imported, and
    importing it took 0.4 s of a 2.3 s first call on a Keras 3 MLP (2-core
    CPU), so it is never imported here."""
    return sys.modules.get("tf_keras")


def keras_modules() -> tuple[ModuleType, ...]:
    """The installed Keras flavours: Keras 3 and ``tf_keras``, where present."""
    return tuple(m for m in (keras3(), tf_keras()) if m is not None)


def needs_autograph(model: Any) -> bool:
    """False for a Keras 3 layer or model, whose code AutoGraph never
    converts; True otherwise.

    NOTE (why AutoGraph is off for Keras 3 models). AutoGraph rewrites the
    Python source of every function a traced computation calls that is not on
    its do-not-convert list, jacobkit's own included: measured on the MLP of
    the auto benchmark (2-core CPU, TensorFlow 2.21), converting jacobkit's
    functions took 1.2 s of a 2.4-3.3 s first call, while tracing the model
    itself took 0.04 s. jacobkit's computations need none of it: their loops
    and conditions are TensorFlow ops (``tf.while_loop``, ``tf.map_fn``,
    ``tf.vectorized_map``) or Python over static values. What the model
    computes does not change either for a Keras 3 model: the ``keras``
    package is on AutoGraph's do-not-convert list and Keras 3 does not convert
    layers itself, so a Keras 3 model's code runs as written with AutoGraph on
    or off (checked: a subclassed layer with a Python ``if`` on a tensor fails
    the same way under both). A ``tf_keras`` model converts its subclassed
    layers' ``call`` only while AutoGraph is on, and a plain callable ``f(x)``
    is converted by it: those keep AutoGraph, and their first call keeps its
    cost.
    """
    keras = keras3()
    return keras is None or not isinstance(model, keras.layers.Layer)


def light_options(options: Any) -> Any:
    """TensorFlow's function options ``options`` (a ``FunctionCallOptions``)
    with a lighter graph optimizer where they leave it at TensorFlow's
    defaults (a choice of the caller's is kept): one round of it, and no
    memory optimizer where no GPU is visible; made once per distinct options
    (``ProcessState.facts``).

    NOTE (why, measured). TensorFlow optimizes a function's graph when it
    first runs it, every optimizer once, then every one again on what the
    first round left. On the reductions benchmark's conv net and BERT tiny
    (both CPU kinds) neither the second round nor the memory optimizer (on
    a CPU: swapping to the host, recomputation where nodes ask for it)
    changed a node of jacobkit's computations (TensorFlow's log: ``Graph
    size after: 170 nodes (0)``); both cost the first call. One core,
    loaded, oneDNN off, a fresh model's first call after one of each, the
    computation's first run: one round ``jk.gram`` 62.7 -> 47.1 ms, the
    clipped sum 52.6 -> 41.5, the projection 47.0 -> 36.5 (the plain step's
    23.8); the memory optimizer left out too, ``jk.gram`` 48.4 -> 42.9, the
    clipped sum 42.2 -> 36.3."""
    from tensorflow.core.protobuf import config_pb2, rewriter_config_pb2
    from tensorflow.python.eager import context

    serialized = options.config_proto_serialized or b""

    def made() -> Any:
        config = config_pb2.ConfigProto()
        config.ParseFromString(serialized)
        rewrite = config.graph_options.rewrite_options
        kinds = rewriter_config_pb2.RewriterConfig
        if rewrite.meta_optimizer_iterations == kinds.DEFAULT_NUM_ITERS:
            rewrite.meta_optimizer_iterations = kinds.ONE
        cpu_only = not tf.config.list_logical_devices("GPU")
        if cpu_only and rewrite.memory_optimization == kinds.DEFAULT_MEM_OPT:
            rewrite.memory_optimization = kinds.NO_MEM_OPT
        return context.FunctionCallOptions(options.executor_type, config)

    key = ("light graph optimizer", serialized, options.executor_type)
    return runtime.measured_once(key, made)


class LightOptimized:
    """A compiled function (``tf.function``, ``keras.state.Compiled``) whose
    eager calls run with :func:`light_options`: this thread's, for the
    call, put back after it (nothing of the process's configuration
    changes). Traced into another function (a ``jk.function`` in the
    caller's ``tf.function``, the factors in a Gram matrix's products) a call
    is the enclosing function's, optimized as that one is. Anything else
    (its traces, ``get_concrete_function``) is the function's own."""

    def __init__(self, function: Any) -> None:
        self.function = function

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from tensorflow.python.eager import context

        if not tf.executing_eagerly():
            return self.function(*args, **kwargs)
        ctx = context.context()
        theirs = ctx.function_call_options
        ctx.function_call_options = light_options(theirs)
        try:
            return self.function(*args, **kwargs)
        finally:
            ctx.function_call_options = theirs

    def __getattr__(self, name: str) -> Any:
        if name == "function":  # not set yet (a copy being made)
            raise AttributeError(name)
        return getattr(self.function, name)


def is_keras_layer(obj: Any) -> bool:
    """True for a Keras 3 or ``tf_keras`` layer (models are layers too)."""
    return any(isinstance(obj, module.layers.Layer) for module in keras_modules())


def is_model(obj: Any) -> bool:
    """True for a Keras 3 or ``tf_keras`` model (a layer of layers)."""
    return any(isinstance(obj, module.Model) for module in keras_modules())


def is_layer(obj: Any) -> bool:
    """True for a Keras layer or any other ``tf.Module``."""
    return is_keras_layer(obj) or isinstance(obj, tf.Module)


def unwrap(variable: Any) -> Any:
    """The ``tf.Variable`` behind a Keras 3 variable; anything else as it is.

    Keras 3 variables are not ``tf.Variable`` objects: ``tape.watch`` and
    ``tf.autodiff.ForwardAccumulator`` reject them. With the TensorFlow
    backend each one wraps a ``tf.Variable`` that every read goes through, so
    watching that one is watching the Keras variable. This is the one place
    jacobkit unwraps them.
    """
    if isinstance(variable, tf.Variable):
        return variable
    inner = getattr(variable, "_value", None)
    return inner if isinstance(inner, tf.Variable) else variable


def as_tf_variable(variable: Any) -> tf.Variable:
    """The ``tf.Variable`` behind ``variable`` (see :func:`unwrap`); raises
    ``TypeError`` for anything that is not a variable."""
    inner = unwrap(variable)
    if isinstance(inner, tf.Variable):
        return inner
    raise TypeError(
        "jacobian(layer=...): expected a tf.Variable or keras.Variable in the "
        f"list of targets, got {type(variable).__name__}: {variable!r}. Pass a "
        "layer, a layer name, or a list of the model's variables."
    )


def flatten_layers(model: Any, *, recursive: bool = True) -> list[Any]:
    """The layers (or sub-modules) inside ``model``, itself excluded: every
    nested one, or with ``recursive=False`` the ones it holds directly
    (sub-models, wrapped layers, cells). A plain ``tf.Module`` lists its
    ``submodules``; anything else has none."""
    flatten = getattr(model, "_flatten_layers", None)
    if flatten is not None:
        return list(flatten(include_self=False, recursive=recursive))
    if recursive and isinstance(model, tf.Module):
        return list(model.submodules)
    return []


# -- variables -----------------------------------------------------------------
def variable_path(variable: Any) -> str:
    """A variable's path (Keras 3: ``"dense/kernel"``) or, without one, its
    name (``tf.Variable``, ``tf_keras``: ``"dense/kernel:0"``)."""
    return getattr(variable, "path", None) or variable.name


def weights(layer: Any) -> list[Any]:
    """The Keras ``weights`` of ``layer`` (a model's are all of its layers');
    empty for anything without them (a plain ``tf.Module``)."""
    return list(getattr(layer, "weights", ()))


def variables(model: Any) -> list[Any]:
    """The Keras ``variables`` of ``model`` (its weights plus any other state
    Keras tracks, e.g. seed generators) or a ``tf.Module``'s; empty for
    anything else."""
    return list(getattr(model, "variables", ()))


def weights_or_variables(layer: Any) -> list[Any]:
    """The Keras ``weights`` of ``layer``, or for a plain ``tf.Module`` (which
    has none) its ``variables``."""
    found = getattr(layer, "weights", None)
    return list(found) if found is not None else variables(layer)


def named_weight(layer: Any, role: str) -> Any:
    """The layer's attribute ``role`` (``"kernel"``, ``"bias"``) as stock
    Keras layers hold their weights, or ``None`` where it has none."""
    return getattr(layer, role, None)


# -- layer configuration -------------------------------------------------------
def layer_class(keras: ModuleType, name: str) -> type | None:
    """The class ``keras.layers.<name>`` of a Keras flavour, or ``None``."""
    return getattr(keras.layers, name, None)


def built_input_shape(layer: Any) -> tuple[int | None, ...] | None:
    """The input shape a layer was built for, as Keras recorded it
    (``tf_keras``: ``_build_input_shape``; Keras 3: ``_build_shapes_dict``),
    or ``None`` where it recorded none (one input) or several."""
    shape = getattr(layer, "_build_input_shape", None)
    if shape is None:
        shapes = getattr(layer, "_build_shapes_dict", None) or {}
        if len(shapes) != 1:
            return None
        shape = next(iter(shapes.values()))
    try:
        return tuple(None if d is None else int(d) for d in shape)
    except (TypeError, ValueError):  # not a shape, or of unknown rank
        return None


def imported_class(path: str) -> type | None:
    """The class ``"package.module:Class"`` names, where that module is
    imported already (nothing is imported here: a library's layer is only
    met once the library is), else ``None``."""
    module_name, _, qualname = path.partition(":")
    found: Any = sys.modules.get(module_name)
    for part in qualname.split("."):
        found = getattr(found, part, None) if found is not None else None
    return found if isinstance(found, type) else None


def compute_dtype(layer: Any) -> str | None:
    """The dtype a Keras layer computes in (``"float16"`` under
    ``mixed_float16``), or ``None`` for anything that is not a Keras layer."""
    return getattr(layer, "compute_dtype", None)


def dtype_policy_name(model: Any) -> str | None:
    """The name of a Keras model's dtype policy (``"mixed_float16"``), or
    ``None`` where it has none."""
    return getattr(getattr(model, "dtype_policy", None), "name", None)


def activation(layer: Any) -> Any:
    """The ``activation`` a Keras layer applies to its output, or ``None``
    for a layer without one."""
    return getattr(layer, "activation", None)


def activation_name(function: Any) -> str | None:
    """The ``__name__`` of an activation function (``"relu"``), or ``None``
    for an object without one."""
    return getattr(function, "__name__", None)


def stock_activation(keras: ModuleType, function: Any) -> str | None:
    """The name of ``function`` if it is ``keras.activations.<name>`` itself
    (not a function of the same name defined elsewhere), else ``None``."""
    name = activation_name(function)
    if name is None or getattr(keras.activations, name, None) is not function:
        return None
    return name


def data_format(layer: Any, default: str | None = None) -> str | None:
    """A convolution's ``data_format`` (``"channels_last"`` or
    ``"channels_first"``); ``default`` for a layer without one."""
    return getattr(layer, "data_format", default)


def groups(layer: Any) -> int:
    """A convolution's ``groups`` (1 for a layer without them)."""
    return getattr(layer, "groups", 1)


def lora_enabled(layer: Any) -> bool:
    """True for a Keras 3 layer with LoRA enabled (its kernel is then
    ``kernel + lora_a @ lora_b``)."""
    return bool(getattr(layer, "lora_enabled", False))


def trainable(variable: Any) -> bool:
    """Whether a Keras or TensorFlow variable is trainable now (a Keras 3
    variable's own flag: setting it leaves its ``tf.Variable``'s as it was
    created)."""
    return bool(getattr(variable, "trainable", True))


def lora_frozen(layer: Any, role: str) -> Any:
    """A LoRA-enabled Keras 3 layer's frozen weight in ``role``
    (``"kernel"``, ``"embeddings"``): the variable its public attribute of
    that name adds the factors' product to (``layer.kernel`` is then a
    computed tensor; Keras keeps the variable as ``_kernel``)."""
    return getattr(layer, f"_{role}")


def lora_scale(layer: Any) -> float:
    """The factor a LoRA-enabled Keras 3 layer multiplies its factors'
    product by: ``lora_alpha / lora_rank``."""
    return float(layer.lora_alpha) / float(layer.lora_rank)


def quantization_mode(layer: Any) -> str | None:
    """The quantization mode of a quantized Keras 3 layer (``"int8"``), or
    ``None`` (falsy) for one that is not quantized."""
    return getattr(layer, "quantization_mode", None)


# -- models --------------------------------------------------------------------
def unbuilt(model: Any) -> bool:
    """True only for a Keras layer or model that says it is not built yet;
    objects that do not say (plain callables, ``tf.Module``) count as built."""
    return getattr(model, "built", True) is False


def declared_inputs(model: Any) -> list[Any]:
    """The input tensors a Keras model declares (functional models, built
    ``Sequential`` ones); empty for one that declares none. Keras may raise
    ``ValueError`` for some models that cannot say."""
    return list(getattr(model, "inputs", None) or [])


def input_names(model: Any) -> list[str | None]:
    """The name of each input tensor the model declares (:func:`declared_inputs`),
    ``None`` for one without a name."""
    return [getattr(t, "name", None) for t in declared_inputs(model)]


def output_names(model: Any) -> list[Any] | None:
    """A Keras model's ``output_names`` (empty where it has none), or
    ``None`` where asking raises (Keras does for some models it cannot say)."""
    try:
        return list(getattr(model, "output_names", None) or [])
    except (AttributeError, ValueError):
        return None


@contextlib.contextmanager
def name_scopes_kept() -> Iterator[None]:
    """Keras 3's stack of open name scopes as it was, after the block: a
    model call that fails inside ``tf.function`` leaves its scopes open.

    NOTE (why). A model named after a private class (``"__net"``) fails
    TensorFlow's root name scope check after Keras pushed its own scope; the
    scope stayed on Keras's global stack, and every variable built later in
    the process got the ``__net/`` prefix in its path (plan-cache and
    ``out=`` fingerprints then differed between processes)."""
    keras = keras3()
    if keras is None:
        yield
        return
    from keras.src.backend.common import global_state

    stack = global_state.get_global_attribute("name_scope_stack")
    depth = len(stack) if stack else 0
    try:
        yield
    finally:
        stack = global_state.get_global_attribute("name_scope_stack")
        if stack and len(stack) > depth:
            del stack[depth:]
