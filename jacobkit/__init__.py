"""jacobkit: per-output Jacobians of TensorFlow/Keras models.

>>> import jacobkit as jk
>>> res = jk.jacobian(model, inputs, "dense")   # doctest: +SKIP
>>> res.kernel.shape                            # (F, *kernel.shape)  # doctest: +SKIP
"""

from jacobkit import strategies
from jacobkit.api import jacobian
from jacobkit.planner import Plan
from jacobkit.result import JacobianResult, Stats

__version__ = "0.1.0"

__all__ = ["JacobianResult", "Plan", "Stats", "jacobian", "strategies", "__version__"]
