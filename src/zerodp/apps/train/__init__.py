"""``zerodp train`` behind the command line: the per-rank loop, the report, the launcher.

Single machine: ``zerodp train [options]`` starts its own ranks with torch's elastic launcher.
Under torchrun every rank runs the same entry point (``rank_main``), on one node or many; run
this on every node (global rank 0 writes the report)::

    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        --rdzv-id my-run -m zerodp.apps.train --steps 1000

``python -m zerodp.apps.train`` takes the same options as ``zerodp train``; outside torchrun it
launches local ranks exactly as ``zerodp train`` does.

Modules: ``options`` (the picklable run options); one rank's training: ``loop`` (the entry
point and one stage), ``world`` (joining the process group), ``steps`` (the optimizer steps and
their curves), ``checkpoints`` (resume and save); the report, pure functions: ``report``
(report.json, and every report name re-exported), ``result`` (``RunResult``), ``theory`` (the
paper's memory and traffic), ``summary`` (terminal text), ``figures`` (report.png); launching:
``launch`` (local launching and failure reporting; the launcher itself is ``zerodp.comm.launch``,
shared with ``zerodp bench``). Import them directly; this package imports nothing heavy on its
own.
"""
