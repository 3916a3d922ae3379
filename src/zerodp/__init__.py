"""zerodp: ZeRO (Zero Redundancy Optimizer) data parallelism for any PyTorch model.

model, opt = zerodp.initialize(model, opt, zerodp.ZeroConfig(stage=2))
"""

from zerodp.api import initialize
from zerodp.comm import CommStats
from zerodp.config import ZeroConfig
from zerodp.memory.report import MemoryReport
from zerodp.module import ZeroModule
from zerodp.optim.optimizer import ZeroOptimizer

__all__ = [
    "CommStats",
    "MemoryReport",
    "ZeroConfig",
    "ZeroModule",
    "ZeroOptimizer",
    "initialize",
]
__version__ = "0.1.0"
