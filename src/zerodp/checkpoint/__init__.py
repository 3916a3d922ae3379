"""Sharded checkpoints: atomic save, exact resume, resharding on load, offline consolidation.

See [Note: checkpoint format] in ``manifest.py`` and docs/checkpoints.md.
"""

from zerodp.checkpoint.consolidate import ConsolidateResult, consolidate_checkpoint
from zerodp.checkpoint.directory import resolve as resolve_checkpoint
from zerodp.checkpoint.integrity import UnverifiedCheckpointWarning
from zerodp.checkpoint.load import load_checkpoint, load_model_state_dict
from zerodp.checkpoint.manifest import CheckpointError, Manifest, read_manifest
from zerodp.checkpoint.save import save_checkpoint

__all__ = [
    "CheckpointError",
    "ConsolidateResult",
    "Manifest",
    "UnverifiedCheckpointWarning",
    "consolidate_checkpoint",
    "load_checkpoint",
    "load_model_state_dict",
    "read_manifest",
    "resolve_checkpoint",
    "save_checkpoint",
]
