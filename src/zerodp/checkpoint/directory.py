"""The checkpoint root on disk: step directories, the ``latest`` pointer, atomic publication.

A root holds ``step-00001000/`` directories (one complete checkpoint each) and a ``latest`` file
naming the newest. A save writes into a hidden ``.step-00001000.tmp-<nonce>/`` next to its target
and becomes visible only through ``os.rename`` once every file is written and fsynced, so a
crash at any point leaves at most a hidden temporary directory (removed by the next save) and
never a half-written directory under a checkpoint's name. Only rank 0 calls the functions that
change the root; they assume one training job, and one data-parallel group of it, per root
(``save_checkpoint`` enforces the latter: [Note: one data-parallel group per root] in save.py).
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
from pathlib import Path

from zerodp.checkpoint.manifest import MANIFEST, CheckpointError

LATEST = "latest"
_STEP_DIR = re.compile(r"step-(\d+)")
_STALE = re.compile(r"\.step-\d+\.(tmp|old)-[0-9a-f]+")


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def fsync_path(path: str | os.PathLike[str]) -> None:
    """fsync a file or a directory (a directory's fsync makes renames inside it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_tmp_dir(root: Path, name: str) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    # secrets, not random/torch: saving must not consume the training RNG (exact resume).
    tmp = root / f".{name}.tmp-{secrets.token_hex(6)}"
    tmp.mkdir()
    return tmp


def publish(tmp: Path, final: Path) -> None:
    """Make the fully written ``tmp`` visible as ``final`` with one rename. Re-saving an existing
    step replaces it with two renames (aside, then into place): ``final`` is briefly absent."""
    for child in tmp.iterdir():
        fsync_path(child)
    fsync_path(tmp)
    aside = None
    if final.exists():
        aside = final.parent / f".{final.name}.old-{secrets.token_hex(6)}"
        os.rename(final, aside)
    os.rename(tmp, final)
    fsync_path(final.parent)
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)


def write_latest(root: Path, name: str) -> None:
    """Point ``root/latest`` at ``name`` atomically (write a temporary file, then replace)."""
    tmp = root / f".{LATEST}.tmp-{secrets.token_hex(6)}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, root / LATEST)
    fsync_path(root)


def step_dirs(root: Path) -> list[tuple[int, Path]]:
    """Published step directories, oldest first."""
    out = []
    with contextlib.suppress(FileNotFoundError):
        for child in root.iterdir():
            m = _STEP_DIR.fullmatch(child.name)
            if m and child.is_dir():
                out.append((int(m.group(1)), child))
    return sorted(out)


def prune(root: Path, keep_last: int, current: str) -> list[Path]:
    """Delete all but the ``keep_last`` highest-numbered step directories (never ``current``)."""
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1; got {keep_last}")
    dirs = step_dirs(root)
    keep = {p.name for _, p in dirs[-keep_last:]} | {current}
    removed = [p for _, p in dirs if p.name not in keep]
    for p in removed:
        shutil.rmtree(p, ignore_errors=True)
    return removed


def remove_stale(root: Path) -> None:
    """Remove temporary directories left by saves that crashed (they never look valid)."""
    with contextlib.suppress(FileNotFoundError):
        for child in root.iterdir():
            if _STALE.fullmatch(child.name) and child.is_dir():
                shutil.rmtree(child, ignore_errors=True)
            elif child.name.startswith(f".{LATEST}.tmp-"):
                child.unlink(missing_ok=True)


def resolve(path: str | os.PathLike[str]) -> Path:
    """The checkpoint directory ``path`` denotes: itself if it holds a manifest, else the one
    its ``latest`` names, else (a crash between publishing and updating ``latest``) its newest
    step directory."""
    p = Path(path)
    if (p / MANIFEST).is_file():
        return p
    latest = p / LATEST
    if latest.is_file():
        name = latest.read_text(encoding="utf-8").strip()
        target = p / name
        if not (target / MANIFEST).is_file():
            raise CheckpointError(f"{latest} names {name!r}, which is not a complete checkpoint")
        return target
    dirs = [d for _, d in step_dirs(p) if (d / MANIFEST).is_file()]
    if dirs:
        return dirs[-1]
    raise CheckpointError(
        f"no checkpoint at {p}: it has neither {MANIFEST} nor a '{LATEST}' pointer nor "
        "step-* directories"
    )
