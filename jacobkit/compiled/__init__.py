"""``jk.function``: the compiled entry point, planned once on an example
batch, then called inside ``tf.function``, a Keras ``train_step`` under
``model.fit`` and ``tf.distribute`` replicas (:mod:`.entry`); what each
traced signature is fed (:mod:`.signatures`). This package face only hands
names on."""

from jacobkit.compiled.entry import CompiledOutput, Function, function

__all__ = ["CompiledOutput", "Function", "function"]
