"""User-facing configuration: ``ZeroConfig`` and its nested policies, frozen and validated.

``zero.py``: ``ZeroConfig``; ``policies.py``: ``Precision``, ``LossScaling``, ``Stage3``;
``offload.py``: ``OffloadConfig``; ``activations.py``: ``Activations``;
``nesting.py``: what makes a policy ([Note: nested policies]); ``checks.py``: value checks;
``legacy.py``: the flat names of 0.1, deprecated ([Note: flat names]).
"""

from zerodp.config.activations import Activations
from zerodp.config.offload import GRADIENT_TIERS, HOST_GRADIENTS, TIERS, OffloadConfig
from zerodp.config.policies import (
    NONFINITE,
    PRECISIONS,
    REDUCE_DTYPES,
    LossScaling,
    Precision,
    Stage3,
)
from zerodp.config.zero import STAGES, STEP_WITHOUT_BACKWARD, ZeroConfig

__all__ = [
    "GRADIENT_TIERS",
    "HOST_GRADIENTS",
    "NONFINITE",
    "PRECISIONS",
    "REDUCE_DTYPES",
    "STAGES",
    "STEP_WITHOUT_BACKWARD",
    "TIERS",
    "Activations",
    "LossScaling",
    "OffloadConfig",
    "Precision",
    "Stage3",
    "ZeroConfig",
]
