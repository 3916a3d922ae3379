"""ZeRO-Offload: the optimizer step on the CPU over host-resident masters and optimizer state,
overlapped with the device's work ([Note: offloaded step] in runner.py).

``runner.py``: ``OffloadStep``, the step runner; ``landing.py``: when each bucket's update is
back on the device; ``ring.py``: the bounded host transfer buffers; ``host_step.py``: stepping
the user's optimizer on one bucket's pieces from a worker thread. Nothing is imported here:
the parameter gathers import ``landing`` without the runner.
"""
