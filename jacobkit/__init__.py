"""jacobkit: per-output Jacobians of TensorFlow/Keras models.

>>> import jacobkit as jk
>>> res = jk.jacobian(model, inputs, "dense")   # doctest: +SKIP
>>> res.kernel.shape                            # (F, *kernel.shape)  # doctest: +SKIP
"""

from jacobkit import memory

# Before TensorFlow's runtime starts, switch its CPU allocator to the one that
# keeps statistics, so that peak memory can be measured and budgets planned
# on CPU (no effect once TF has started; TF_CPU_ALLOCATOR_USE_BFC=false opts out).
memory.enable_cpu_memory_stats()

from jacobkit import data, strategies  # noqa: E402
from jacobkit.api import jacobian, plan  # noqa: E402
from jacobkit.planner import Plan  # noqa: E402
from jacobkit.result import JacobianResult, Stats  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "JacobianResult",
    "Plan",
    "Stats",
    "__version__",
    "data",
    "jacobian",
    "memory",
    "plan",
    "strategies",
]
