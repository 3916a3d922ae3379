"""torch's elastic-launch error recording, re-exported so that the training entry point does not
import ``torch.distributed`` itself (comm is the one package that does)."""

from torch.distributed.elastic.multiprocessing.errors import record

__all__ = ["record"]
