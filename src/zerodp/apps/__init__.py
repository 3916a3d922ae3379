"""Applications built on zerodp: the ``zerodp`` command (``cli``), the demo trainer (``train``),
the benchmark (``bench``), and the GPT and corpus they ship with (``models``, ``data``).

The layering rule, checked by ``tests/unit/test_layering.py`` (statically, with ``ast``):

* The library never imports ``zerodp.apps`` (not at the top of a module, not inside a function,
  not through ``importlib``): ``import zerodp`` works without the applications.
* The applications import from the library only its public API: the names in the ``__all__`` of
  each module in ``PUBLIC_API`` (``zerodp.__version__`` too). Anything else is an internal that
  may change without notice. When an application needs an internal, either export it from one of
  these modules (add it to its ``__all__``) because users need it as well, or do without it;
  adding a module to ``PUBLIC_API`` makes all of its ``__all__`` public, so do it rarely.

Scripts under ``benchmarks/`` and the tests may use internals: they measure and test them.
"""

PUBLIC_API = (
    "zerodp",  # initialize, ZeroConfig + policies, ZeroModule, ZeroOptimizer, checkpoints, reports
    "zerodp.checkpoint",  # save, load, consolidate, read_manifest, resolve_checkpoint
    "zerodp.comm",  # joining and leaving the process group, Communicator, CommStats
    "zerodp.comm.launch",  # starting local ranks with torch's elastic launcher, @record
    "zerodp.config",  # ZeroConfig, its policies, the choices of their fields (STAGES, ...)
    "zerodp.memory",  # the theoretical per-rank memory estimator (pure math)
    "zerodp.tensor_parallel",  # Megatron-style layers over the TP group of a DP x TP mesh
)
"""The library modules the applications may import from (only the names in their ``__all__``)."""
