"""Per-rank RNG state: torch CPU (and CUDA) generators, Python's ``random``, numpy's global.

Tensor states go into the rank's safetensors file, the rest into the manifest as JSON. Restored
only when the world size is unchanged (rank r gets rank r's state): at another world size there
is no meaningful mapping, and data order must come from the user's ``extra`` instead.
"""

from __future__ import annotations

import random
import sys
from typing import Any

import torch

from zerodp.checkpoint.manifest import RNG_TORCH, rng_cuda_key


def capture() -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    tensors = {RNG_TORCH: torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, state in enumerate(torch.cuda.get_rng_state_all()):
            tensors[rng_cuda_key(i)] = state
    version, internal, gauss = random.getstate()
    info: dict[str, Any] = {
        "tensors": sorted(tensors),  # keys in the rank file
        "python": [version, list(internal), gauss],
        "numpy": None,
    }
    np = sys.modules.get("numpy")  # only if the program uses numpy; never import it for this
    if np is not None:
        name, keys, pos, has_gauss, cached = np.random.get_state()
        info["numpy"] = [name, keys.tolist(), int(pos), int(has_gauss), float(cached)]
    return tensors, info


def restore(tensors: dict[str, torch.Tensor], info: dict[str, Any]) -> None:
    torch.set_rng_state(tensors[RNG_TORCH])
    cuda = [tensors[k] for k in sorted(tensors) if k.startswith("rng/cuda/")]
    if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)
    version, internal, gauss = info["python"]
    random.setstate((version, tuple(internal), gauss))
    np = sys.modules.get("numpy")
    if np is not None and info.get("numpy") is not None:
        name, keys, pos, has_gauss, cached = info["numpy"]
        np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
