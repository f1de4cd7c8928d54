"""What is differentiated, resolved once: :class:`Problem` and the pieces it
is made of; :class:`Call`, one call's arguments, which builds it.

- :mod:`.rows`: ``outputs=`` and ``features=`` (:class:`Rows`);
  :mod:`.outputs`: ``output=`` of a multi-output model.
- :mod:`.targets`: ``layer=`` as a layer, name or variables (:class:`Targets`);
  :mod:`.tensor_targets`: ``Inputs()`` and ``Output("layer")``.
- :mod:`.inspect`: the one traced pass (:class:`Inspection`).
- :mod:`.cache`: per-model state, each kind declared by the module keeping
  it (:class:`PerModel`); :mod:`.key`: a problem's one identity in it
  (:class:`ProblemKey`).
- :mod:`.structure`: the exact shortcuts a model's structure allows
  (:mod:`.linear_head`, :mod:`.separable_channels`).
- :mod:`.solution`: what computes a call and what it answers (the
  :class:`~.solution.Solver` protocol every strategy and ``auto`` satisfy,
  :class:`~.solution.Solution`, :class:`~.solution.Stats`); :mod:`.plan`:
  ``auto``'s :class:`~.plan.Plan` and its records. They rank here, below the
  strategies they name, so that no type points upward.
"""

from jacobkit.problem.arguments import REDUCE_MODES, UNCONNECTED_MODES
from jacobkit.problem.cache import PerModel
from jacobkit.problem.call import Call
from jacobkit.problem.inspect import Inspection
from jacobkit.problem.key import CallKey, ProblemKey
from jacobkit.problem.problem import Problem, measure_inspection
from jacobkit.problem.rows import OUTPUT_MODES, Rows
from jacobkit.problem.targets import Roles, Targets

__all__ = [
    "Call",
    "CallKey",
    "OUTPUT_MODES",
    "REDUCE_MODES",
    "UNCONNECTED_MODES",
    "Inspection",
    "PerModel",
    "Problem",
    "measure_inspection",
    "ProblemKey",
    "Roles",
    "Rows",
    "Slot",  # going away (see .cache)
    "Targets",
    "model_state",  # going away (see .cache)
]
