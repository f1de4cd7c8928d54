"""The registry of layer kinds: for each layer class jacobkit knows, its
closed-form rule (or none) and its facts, in one typed record
(:class:`LayerKind`).

A kind names a stock Keras class by its name (``"Dense"``: the class of that
name in every Keras flavour imported, Keras 3 and ``tf_keras``), a class of
another library by its path (``"package.module:ClassName"``, looked up only
once that module is imported: jacobkit imports no library to know its
layers), or a layer class itself. A layer's kind is that of the first
registered class in its method resolution order: its own class if
registered, else its nearest registered base (a subclass of ``Dense`` gets
``Dense``'s rule; ``tf_keras``'s ``DepthwiseConv2D``, a ``Conv2D`` there, its
own). The facts of a stock kind
hold for exactly its class (:meth:`LayerRegistry.stock`): a subclass may
change ``call``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Literal, get_args

from jacobkit.keras import compat
from jacobkit.layers import convolutions
from jacobkit.layers.base import LayerRule

#: how a layer's output before its activation is linear in its input, the
#: kernel's last axis its output channels: ``"matmul"``, ``x @ K + b`` over
#: the last axis (``Dense``); ``"convolution"``, ``conv(x, K) + b``
#: (``Conv1D``/``2D``/``3D``). The structure finder's shortcuts rest on it.
Linear = Literal["matmul", "convolution"]
LINEAR: tuple[str, ...] = get_args(Linear)


@dataclass(frozen=True)
class LayerKind:
    """What jacobkit knows about one layer class.

    Attributes:
        layer: a stock Keras class name (``"Dense"``), or a layer class.
        rule: the closed forms ``batch`` computes beside the layer
            (:class:`~jacobkit.layers.base.LayerRule`), or ``None``.
        linear: how its output before its activation is linear in its input
            (:data:`Linear`), or ``None``.
        elementwise: it acts on each element alone, given its activation
            where it has one (``Activation``, ``ReLU``, ...).
        inference_identity: it is the identity at inference (random and
            elementwise in training: ``Dropout``, ...).
        convolutions: the kinds of convolution its backward pass runs
            (:data:`jacobkit.layers.convolutions.KINDS`).
        recurrent: it loops over time steps in a ``tf.while_loop`` (``RNN``
            and its subclasses, ``Bidirectional``): what pfor and forward mode
            see of its gradient differs.
        lora: the closed forms of a layer of the class with LoRA enabled
            (Keras 3's ``enable_lora``: the factors trainable, the kernel
            frozen), or ``None``: ``rule`` then refuses such a layer.
    """

    layer: str | type
    rule: type[LayerRule] | None = None
    linear: Linear | None = None
    elementwise: bool = False
    inference_identity: bool = False
    convolutions: tuple[str, ...] = ()
    recurrent: bool = False
    lora: type[LayerRule] | None = None

    @property
    def name(self) -> str:
        """The class name (``"Dense"``)."""
        if isinstance(self.layer, str):
            return self.layer.rpartition(":")[2].rpartition(".")[2]
        return self.layer.__name__

    @property
    def pfor_vectorizes(self) -> bool:
        """Whether TensorFlow's vectorization (pfor) converts its gradient
        without a while-loop fallback: not where it runs a convolution
        without a pfor rule (a depthwise, separable or 3-D convolution)."""
        return all(convolutions.convolution(k).pfor_rule for k in self.convolutions)

    def classes(self, modules: Iterable[ModuleType]) -> tuple[type, ...]:
        """The classes it names: its class, or the stock class of its name in
        each Keras flavour of ``modules`` that has one."""
        if not isinstance(self.layer, str):
            return (self.layer,)
        if ":" in self.layer:  # a library's class, by its path
            cls = compat.imported_class(self.layer)
            return () if cls is None else (cls,)
        found = (compat.layer_class(module, self.layer) for module in modules)
        return tuple(cls for cls in found if cls is not None)


class LayerRegistry:
    """The layer kinds, in the order registered, looked up by a layer's
    class (:meth:`of`, :meth:`stock`). Registering a class with a rule is one
    call: ``registry.add(LayerKind(cls, rule=SomeRule))``."""

    def __init__(self, kinds: Iterable[LayerKind] = ()) -> None:
        self._kinds: list[LayerKind] = []
        #: the Keras flavours imported -> {class: its kind}, built on first
        #: use (``tf_keras`` counts once it is imported); cleared by :meth:`add`
        self._by_class: dict[Any, dict[type, LayerKind]] = {}
        #: counts the kinds added: every per-model state (plans, compiled
        #: computations, the batch checks) keys by it through the problem's
        #: key, so a rule registered later is seen by the next call
        self.version = 0
        for kind in kinds:
            self.add(kind)

    def add(self, kind: LayerKind) -> LayerKind:
        """Register ``kind``.

        Raises:
            ValueError: its class is registered already, or a fact names
                something unknown (the message lists the choices).
            TypeError: its rule is not a ``LayerRule`` class, or its layer
                neither a class name nor a class.
        """
        if not isinstance(kind.layer, str | type):
            raise TypeError(
                f"a layer kind names a Keras class name or a layer class, got "
                f"{type(kind.layer).__name__}: {kind.layer!r}"
            )
        for rule, what in ((kind.rule, "rule"), (kind.lora, "LoRA rule")):
            if rule is not None and not (
                isinstance(rule, type) and issubclass(rule, LayerRule)
            ):
                raise TypeError(
                    f"the {what} of {kind.name} must be a LayerRule subclass, "
                    f"got {rule!r}"
                )
        # a class is also checked against the stock classes of its name
        # (a stock name is not resolved here: that would import Keras)
        if any(known.layer == kind.layer for known in self._kinds) or (
            isinstance(kind.layer, type) and kind.layer in self._classes()
        ):
            raise ValueError(
                f"layer {kind.name} is registered already (registered: "
                f"{', '.join(k.name for k in self._kinds)})"
            )
        if kind.linear is not None and kind.linear not in LINEAR:
            raise ValueError(
                f"layer {kind.name}: unknown linear={kind.linear!r}; choose from "
                f"{', '.join(repr(k) for k in LINEAR)} or None"
            )
        for each in kind.convolutions:
            convolutions.convolution(each)  # raises, listing the kinds
        self._kinds.append(kind)
        self._by_class.clear()
        self.version += 1
        return kind

    def current_version(self) -> int:
        """:attr:`version` now (what a problem's key is made with)."""
        return self.version

    @property
    def kinds(self) -> tuple[LayerKind, ...]:
        """Every kind, in the order registered."""
        return tuple(self._kinds)

    def _classes(self) -> dict[type, LayerKind]:
        """``{class: its kind}`` for the Keras flavours and the libraries
        imported now."""
        modules = compat.keras_modules()
        imported = tuple(
            compat.imported_class(k.layer) is not None
            for k in self._kinds
            if isinstance(k.layer, str) and ":" in k.layer
        )
        found = self._by_class.get((modules, imported))
        if found is None:
            found = {cls: kind for kind in self._kinds for cls in kind.classes(modules)}
            self._by_class[(modules, imported)] = found
        return found

    def of(self, layer: Any) -> LayerKind | None:
        """The kind of ``layer``: that of its class or of its nearest
        registered base class, or ``None``."""
        classes = self._classes()
        for cls in type(layer).__mro__:
            kind = classes.get(cls)
            if kind is not None:
                return kind
        return None

    def stock(self, layer: Any) -> LayerKind | None:
        """The kind registered for exactly ``layer``'s class (not a
        subclass, which may change ``call``), or ``None``."""
        return self._classes().get(type(layer))

    def with_rules(self) -> str:
        """The kinds with a rule, in words: ``"Dense, Conv1D, ... and
        BatchNormalization (inference mode)"``."""
        return _listed(
            [
                f"{k.name} ({k.rule.covers})" if k.rule.covers else k.name
                for k in self._kinds
                if k.rule is not None
            ]
        )

    def with_lora_rules(self) -> str:
        """The kinds with a rule for LoRA-enabled layers, in words:
        ``"Dense, EinsumDense and Embedding"``."""
        return _listed([k.name for k in self._kinds if k.lora is not None])


def _listed(named: list[str]) -> str:
    """``["a", "b", "c"]`` -> ``"a, b and c"``."""
    if len(named) < 2:
        return "".join(named)
    return f"{', '.join(named[:-1])} and {named[-1]}"
