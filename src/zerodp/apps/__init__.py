"""Applications built on zerodp: the ``zerodp`` command (``cli``), the demo trainer (``train``),
the benchmark (``bench``), and the GPT and corpus they ship with (``models``, ``data``)."""
