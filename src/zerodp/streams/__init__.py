"""The one owner of streams and events: where work that overlaps the computation runs, and how
its completion is awaited ([Note: streams]).

Nothing else in zerodp creates a CUDA stream or event (``tests/unit/test_streams.py`` checks
the sources). ``make_streams(device)`` picks the implementation: ``cuda.CudaStreams`` on a CUDA
device, ``cpu.CpuStreams`` otherwise. Both follow one contract, so the code that uses them is
the same on either and the tests on CPU exercise it.
"""

from zerodp.streams.base import Event, Stream, StreamError, Streams
from zerodp.streams.select import make_streams

__all__ = ["Event", "Stream", "StreamError", "Streams", "make_streams"]
