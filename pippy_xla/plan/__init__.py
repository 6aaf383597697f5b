"""How a plan is made: the profiler (per-layer costs), the cost model, the planner (layer ranges
and checkpointed layers under a memory limit, solved in C++) and drawings of schedules and
timelines. Imports from :mod:`pippy_xla.split`, never from :mod:`pippy_xla.runtime`
(``tests/test_layout.py``).

``pippy_xla.plan`` the attribute is the :func:`plan` function (re-exported by ``pippy_xla``); the
subpackage is reached by ``from pippy_xla.plan import ...``."""

from pippy_xla.plan.cost_model import PLANNED_SCHEDULES, ModelProfile
from pippy_xla.plan.planner import Plan, PlanInfeasibleError, StagePlan, limit_range, plan
from pippy_xla.plan.profiler import profile_model

__all__ = [
    "PLANNED_SCHEDULES",
    "ModelProfile",
    "Plan",
    "PlanInfeasibleError",
    "StagePlan",
    "limit_range",
    "plan",
    "profile_model",
]
