"""Every Keras-flavour dependency of jacobkit (Keras 3, ``tf_keras``, plain
``tf.Module`` objects): detection and unwrapping (:mod:`.compat`), the layer
tree (:mod:`.layer_tree`), running a functional graph with one layer tapped
(:mod:`.graph`) and loading saved models (:mod:`.saved`).

Submodules are imported where they are used, not here.
"""
