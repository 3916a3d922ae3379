"""[Note: values written in a constructor]
Under ``zerodp.sharded_init()`` parameters live on the meta device, which holds no values: a
constructor that writes a parameter (``self.proj.weight.fill_(1.0)``, ``nn.init.zeros_(...)`` of
a child's weight) writes nothing, and ``initialize`` then runs the initialisers
(``init_fn``, ``init_weights()`` or ``reset_parameters()``), so the written values would be lost
silently. While ``sharded_init`` is active, this mode marks every meta parameter written in place
outside an initialiser's frame (``reset_parameters``, ``init_weights``, ...: their writes are
re-run at ``initialize``); ``initialize`` refuses a model with a marked parameter, naming it
(``unwritten_in_constructor``). DeepSpeed's ``zero.Init`` runs constructors for real instead;
FSDP2's meta-device initialisation has the same loss, documented but not detected.
"""

from __future__ import annotations

import sys
from types import FrameType
from typing import Any

from torch import nn
from torch.overrides import TorchFunctionMode

# Functions whose writes initialise (and are run again by ``initialize``).
_INITIALISERS = frozenset(
    {"reset_parameters", "_reset_parameters", "init_weights", "_init_weights", "post_init"}
)
_MARK = "_zerodp_written_in_constructor"


class RecordConstructorWrites(TorchFunctionMode):
    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        name = getattr(func, "__name__", "")
        target = args[0] if args else None
        in_place = name == "__setitem__" or (name.endswith("_") and not name.endswith("__"))
        meta_param = isinstance(target, nn.Parameter) and target.is_meta
        if in_place and meta_param and not _inside_initialiser():
            setattr(target, _MARK, True)
        return out


def _inside_initialiser() -> bool:
    frame: FrameType | None = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name in _INITIALISERS:
            return True
        frame = frame.f_back
    return False


def written_in_constructor(model: nn.Module) -> list[str]:
    """Names of the model's parameters marked by ``RecordConstructorWrites``."""
    return [n for n, p in model.named_parameters() if getattr(p, _MARK, False)]
