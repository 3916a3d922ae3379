"""zerodp: ZeRO (Zero Redundancy Optimizer) data parallelism for any PyTorch model.

model, opt = zerodp.initialize(model, opt, zerodp.ZeroConfig(stage=2))
"""

from zerodp.api import initialize
from zerodp.checkpoint import (
    CheckpointError,
    consolidate_checkpoint,
    load_checkpoint,
    load_model_state_dict,
    save_checkpoint,
)
from zerodp.comm import CommStats
from zerodp.config import ZeroConfig
from zerodp.memory.report import MemoryReport
from zerodp.module import ZeroModule
from zerodp.optim.loss_scaler import StepInfo
from zerodp.optim.optimizer import ZeroOptimizer

__all__ = [
    "CheckpointError",
    "CommStats",
    "MemoryReport",
    "StepInfo",
    "ZeroConfig",
    "ZeroModule",
    "ZeroOptimizer",
    "consolidate_checkpoint",
    "initialize",
    "load_checkpoint",
    "load_model_state_dict",
    "save_checkpoint",
]
__version__ = "0.1.0"
