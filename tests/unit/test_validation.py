"""Device checks name the parameter, its device and the backend (no process group needed);
a config that differs between ranks is named down to the field."""

from __future__ import annotations

import torch
from torch import nn

from zerodp import Stage3, ZeroConfig
from zerodp.comm.communicator import Communicator
from zerodp.validation import _first_difference, check_devices


def _comm(backend: str) -> Communicator:
    comm = Communicator.__new__(Communicator)
    comm.backend = backend
    return comm


def test_cpu_parameter_with_nccl():
    p = nn.Parameter(torch.zeros(2))
    msg = check_devices([("fc.weight", p)], _comm("nccl"))
    assert msg.startswith(
        "parameter 'fc.weight' is on cpu but the process group's backend 'nccl' serves only "
        "cuda tensors"
    ), msg


def test_meta_parameter():
    p = nn.Parameter(torch.empty(2, device="meta"))
    assert "is on the meta device" in check_devices([("w", p)], _comm("gloo"))


def test_mixed_backend_string():
    p = nn.Parameter(torch.zeros(2))
    assert check_devices([("w", p)], _comm("cpu:gloo,cuda:nccl")) == ""


def test_config_difference_names_the_nested_field():
    rank0, rank1 = ZeroConfig(stage=3), ZeroConfig(stage=3, stage3=Stage3(prefetch_depth=2))
    diff = _first_difference(rank0.to_dict(), rank1.to_dict())
    assert diff == "stage3.prefetch_depth=1 on rank 0 vs 2"
    assert _first_difference(rank0.to_dict(), ZeroConfig().to_dict()) == "stage=3 on rank 0 vs 2"
