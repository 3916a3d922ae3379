"""The only package that imports ``torch.distributed``: collectives, handles and the ledger,
and starting local ranks with torch's elastic launcher (``comm.launch``)."""

from zerodp.comm.communicator import Communicator
from zerodp.comm.diagnosis import STEP_PHASES
from zerodp.comm.gloo_cpu import Piece, gaps, receives_point_to_point
from zerodp.comm.groups import DeviceMesh, GroupLike, dp_tp_mesh
from zerodp.comm.handle import Handle
from zerodp.comm.ledger import CONTROL, MODEL, CommLedger, CommStats
from zerodp.comm.process_group import GLOO_WITH_CUDA, destroy, init_from_env
from zerodp.comm.watchdog import BETWEEN_STEPS, CollectiveError

__all__ = [
    "BETWEEN_STEPS",
    "CONTROL",
    "GLOO_WITH_CUDA",
    "MODEL",
    "STEP_PHASES",
    "CollectiveError",
    "CommLedger",
    "CommStats",
    "Communicator",
    "DeviceMesh",
    "GroupLike",
    "Handle",
    "Piece",
    "destroy",
    "dp_tp_mesh",
    "gaps",
    "init_from_env",
    "receives_point_to_point",
]
