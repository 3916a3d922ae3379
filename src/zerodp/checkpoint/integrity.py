"""Checksums over every file of a checkpoint, and reading a manifest only after verifying it.

[Note: checkpoint checksums]
Every tensor file's size and SHA-256 are computed by its writer while it writes
(``TensorFileWriter``: no second pass over the data) and recorded in ``manifest.json``'s
``files``. A file cannot hold its own digest, so rank 0 then writes ``checksums.sha256``: one
line ``<sha256>  <name>`` for ``manifest.json`` and for every tensor file, sorted by name. It is
the format of coreutils' ``sha256sum``, so ``cd step-N && sha256sum -c checksums.sha256``
checks a checkpoint without Python (say, after copying it between machines). It is written
last, before the directory is fsynced and renamed into place (``directory.publish``), so a
published checkpoint has all of its files and checksums or is not published at all; the
manifest records ``"checksums": "checksums.sha256"`` so that a deleted checksum file is told
apart from a checkpoint saved before checksums covered the manifest.

Reading: every rank that reads a checkpoint hashes the manifest's bytes and compares them with
``checksums.sha256`` before parsing them (a hand-edited learning rate or step is refused, not
loaded), checks that the two files list the same digests, then checks the size and SHA-256 of
each tensor file it is going to read (``check_file``). SHA-256 runs at about 1.5-1.7 GiB/s per
core on the development machine (hashlib, SHA-NI; 256 MiB, in memory and from the page cache):
loading hashes each byte it reads once, a small cost beside the read itself.

A checkpoint without ``checksums.sha256`` whose manifest does not claim one was saved before
this file existed: it is loaded with an ``UnverifiedCheckpointWarning`` (its tensor files are
still verified against the manifest; only the manifest itself is not). Refusing it would strand
every run saved by an older zerodp; ``warnings.filterwarnings("error",
category=UnverifiedCheckpointWarning)`` makes it a ``CheckpointError`` on every rank instead.

The checksums catch accidental change (disk or copy corruption, truncation, a hand edit), not
tampering: whoever can rewrite ``manifest.json`` can rewrite ``checksums.sha256`` too.
"""

from __future__ import annotations

import hashlib
import os
import re
import warnings
from typing import Any

from zerodp.checkpoint.manifest import MANIFEST, CheckpointError, Manifest, parse_manifest

CHECKSUMS = "checksums.sha256"
_LINE = re.compile(r"([0-9a-f]{64}) [ *](\S+)")


class UnverifiedCheckpointWarning(UserWarning):
    """A checkpoint saved before zerodp checksummed its manifest is being read unverified."""


def sha256_file(path: str | os.PathLike[str], chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def refusal(directory: str | os.PathLike[str], name: str, what: str, action: str) -> str:
    """The message for a file of a checkpoint that cannot be trusted: which checkpoint, which
    file, what is wrong, and what to do (``action``: "load" or "consolidate")."""
    return f"checkpoint {os.fspath(directory)}: {name} {what}; {action} an earlier checkpoint"


def _changed(expected: str, found: str) -> str:
    what = "file changed or truncated after saving"
    return f"does not match its checksum ({what}: {expected}, {found})"


def _digests(expected: str, got: str) -> str:
    return _changed(f"expected sha256 {expected[:16]}...", f"got {got[:16]}...")


def check_file(
    directory: str | os.PathLike[str], name: str, record: dict[str, Any], action: str = "load"
) -> str:
    """An error message if ``name`` is missing, has another size (checked first: no hashing
    needed) or another SHA-256 than ``record`` (the manifest's ``files`` entry)."""
    path = os.path.join(directory, name)
    try:
        size = os.path.getsize(path)
    except FileNotFoundError:
        return refusal(directory, name, "is missing", action)
    if size != record["size"]:
        what = _changed(f"expected {record['size']} bytes", f"found {size}")
        return refusal(directory, name, what, action)
    digest = sha256_file(path)
    if digest != record["sha256"]:
        return refusal(directory, name, _digests(record["sha256"], digest), action)
    return ""


# -- the checksum file --------------------------------------------------------------------------


def format_checksums(digests: dict[str, str]) -> bytes:
    return "".join(f"{d}  {name}\n" for name, d in sorted(digests.items())).encode("ascii")


def parse_checksums(data: bytes) -> dict[str, str]:
    """name -> SHA-256 from ``sha256sum`` lines; ``ValueError`` naming the first bad line."""
    out: dict[str, str] = {}
    for i, line in enumerate(data.decode("ascii").splitlines(), 1):
        m = _LINE.fullmatch(line)
        if m is None or m.group(2) in out:
            raise ValueError(f"line {i} is not '<sha256>  <file name>' or repeats a name")
        out[m.group(2)] = m.group(1)
    return out


def write_checksums(directory: str | os.PathLike[str], digests: dict[str, str]) -> None:
    """Write ``checksums.sha256`` (the publishing rename fsyncs it with the directory)."""
    with open(os.path.join(directory, CHECKSUMS), "wb") as f:
        f.write(format_checksums(digests))


def read_verified_manifest(directory: str | os.PathLike[str], action: str = "load") -> Manifest:
    """The manifest of the checkpoint ``directory``, parsed only once its bytes match
    ``checksums.sha256`` and the two files agree; ``CheckpointError`` naming the file that
    does not (see [Note: checkpoint checksums])."""
    path = os.path.join(directory, MANIFEST)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise CheckpointError(f"{path} does not exist: not a (complete) checkpoint") from None
    try:
        with open(os.path.join(directory, CHECKSUMS), "rb") as f:
            sums_data: bytes | None = f.read()
    except FileNotFoundError:
        sums_data = None
    if sums_data is None:
        m = _parse(directory, data, action)
        if m.checksums is not None:  # saved with a checksum file, which is gone
            what = f"is missing, so {MANIFEST} cannot be verified"
            raise CheckpointError(refusal(directory, CHECKSUMS, what, action))
        warnings.warn(
            f"checkpoint {os.fspath(directory)} has no {CHECKSUMS} (saved by a zerodp that did "
            f"not checksum {MANIFEST}): its {MANIFEST} is not verified, its tensor files are; "
            "saving it again adds the checksums",
            UnverifiedCheckpointWarning,
            stacklevel=2,
        )
        return m
    try:
        sums = parse_checksums(sums_data)
    except (UnicodeDecodeError, ValueError) as exc:
        what = f"is malformed ({exc})"
        raise CheckpointError(refusal(directory, CHECKSUMS, what, action)) from None
    if MANIFEST not in sums:
        raise CheckpointError(refusal(directory, CHECKSUMS, f"has no line for {MANIFEST}", action))
    digest = hashlib.sha256(data).hexdigest()
    if digest != sums[MANIFEST]:
        what = _digests(sums[MANIFEST], digest)
        raise CheckpointError(refusal(directory, MANIFEST, what, action))
    m = _parse(directory, data, action)
    listed = {name: rec.get("sha256") for name, rec in m.files.items()}
    for name in sorted(set(listed) | (set(sums) - {MANIFEST})):
        if listed.get(name) != sums.get(name):
            what = f"and {MANIFEST} disagree about {name}"
            raise CheckpointError(refusal(directory, CHECKSUMS, what, action))
    return m


def _parse(directory: str | os.PathLike[str], data: bytes, action: str) -> Manifest:
    try:
        return parse_manifest(data.decode("utf-8"), os.path.join(directory, MANIFEST))
    except UnicodeDecodeError as exc:
        what = f"is not UTF-8 text ({exc})"
        raise CheckpointError(refusal(directory, MANIFEST, what, action)) from None
