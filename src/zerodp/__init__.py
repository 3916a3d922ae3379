"""zerodp: ZeRO (Zero Redundancy Optimizer) data parallelism for any PyTorch model.

model, opt = zerodp.initialize(model, opt, zerodp.ZeroConfig(stage=2))
"""

from zerodp.activations import checkpoint_wrapper
from zerodp.api import initialize
from zerodp.checkpoint import (
    CheckpointError,
    consolidate_checkpoint,
    load_checkpoint,
    load_model_state_dict,
    save_checkpoint,
)
from zerodp.comm import CollectiveError, CommStats
from zerodp.config import Activations, LossScaling, OffloadConfig, Precision, Stage3, ZeroConfig
from zerodp.memory.report import MemoryReport
from zerodp.module import ZeroModule
from zerodp.offload.swapfile import OffloadDiskFull
from zerodp.optim.loss_scaler import StepInfo
from zerodp.optim.optimizer import ZeroOptimizer
from zerodp.params import full_parameters, sharded_init
from zerodp.version import __version__ as __version__

__all__ = [
    "Activations",
    "CheckpointError",
    "CollectiveError",
    "CommStats",
    "LossScaling",
    "MemoryReport",
    "OffloadConfig",
    "OffloadDiskFull",
    "Precision",
    "Stage3",
    "StepInfo",
    "ZeroConfig",
    "ZeroModule",
    "ZeroOptimizer",
    "checkpoint_wrapper",
    "consolidate_checkpoint",
    "full_parameters",
    "initialize",
    "load_checkpoint",
    "load_model_state_dict",
    "save_checkpoint",
    "sharded_init",
]
