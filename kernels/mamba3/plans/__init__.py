"""The Triton scan's launch plans, in one home apart from the kernels: what a plan is
(``plan.py``), the checked-in table (``table.py``), this machine's tuned plans (``local.py``)
and the one object that looks a call's plan up among them (``lookup.py``). The kernels'
launchers take a plan's configurations; the tuning tools (``../tools``) write plans.
"""

from ..launching import LaunchConfig
from .local import PLANS_ENV, TUNE_COMMAND, LocalPlans, fingerprint, plans_path
from .lookup import LaunchPlans, arch_key, launch_plans, plan_for
from .plan import (
    DEFAULT_CHUNK,
    DEFAULT_CONFIGS,
    DOT_DTYPES,
    KERNELS,
    Plan,
    dtype_name,
    entry_configs,
    entry_error,
    entry_plan,
    shape_key,
    untuned_plan,
)

__all__ = [
    "DEFAULT_CHUNK",
    "DEFAULT_CONFIGS",
    "DOT_DTYPES",
    "KERNELS",
    "PLANS_ENV",
    "TUNE_COMMAND",
    "LaunchConfig",
    "LaunchPlans",
    "LocalPlans",
    "Plan",
    "arch_key",
    "dtype_name",
    "entry_configs",
    "entry_error",
    "entry_plan",
    "fingerprint",
    "launch_plans",
    "plan_for",
    "plans_path",
    "shape_key",
    "untuned_plan",
]
