"""``zerodp bench``: zerodp stages 0-3 against DDP, ZeroRedundancyOptimizer, FSDP2 and DeepSpeed.

Same model, data and seed for every configuration; each runs in its own launch of torch's
elastic launcher (so its peak RSS is its own). Files: ``systems`` (the configurations and their
theoretical traffic), ``options``, ``launch`` (the parent: one launch per configuration, parity),
``runner`` (one rank's timed steps), ``peers`` / ``deepspeed_peer`` (one adapter per system),
``probe`` (RSS and tensor bytes), ``operators`` (``--profile-steps``: top operators under
torch.profiler), ``parity``, ``table`` (report and tables), ``stats`` (pure statistics).

    from zerodp.apps.bench import BenchOptions, run_bench
    report = run_bench(BenchOptions(preset="tiny", configs=("ddp", "zero2"), steps=2))
"""

from zerodp.apps.bench.launch import run_bench
from zerodp.apps.bench.options import BenchOptions
from zerodp.apps.bench.text import format_report

__all__ = ["BenchOptions", "format_report", "run_bench"]
