"""A checkpoint folder's manifest: every file's size and SHA-256, written last, checked before loading.

`manifest.json` = `{"format": 1, "files": {"<relative path>": {"size": N, "sha256": "<hex>"}}}`. It is
written after every other file of the folder, through a temporary name and an atomic rename, so a
folder with a manifest was complete when written; `verify_manifest` then finds what happened to it
since (a truncated or corrupted shard, a missing or added file, a symlink) and names the file.
"""

from __future__ import annotations

import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor

from rlframe.utils.safe_files import write_file_atomically

MANIFEST = "manifest.json"
FORMAT = 1
_CHUNK = 8 << 20


class CorruptCheckpointError(ValueError):
    """A checkpoint folder does not match its manifest (or has none); the message names the file."""


def sha256_of(path: str) -> str:
    """Hex SHA-256 of a file, read in 8 MiB chunks (hashlib releases the GIL, so files hash in parallel)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _files_under(folder: str) -> list[str]:
    """Relative paths of every file under `folder` except the manifest, sorted; a symlink in it is refused."""
    found = []
    for parent, dirs, names in os.walk(folder):
        for name in dirs + names:
            path = os.path.join(parent, name)
            if os.path.islink(path):  # a save writes none: reading through one would load files from elsewhere
                raise CorruptCheckpointError(
                    f"{path} is a symlink (to {os.readlink(path)}); a checkpoint folder holds only the files its "
                    "save wrote: put the files themselves there"
                )
        for name in names:
            rel = os.path.relpath(os.path.join(parent, name), folder)
            if rel != MANIFEST:
                found.append(rel)
    return sorted(found)


def _hash_all(folder: str, rel_paths: list[str]) -> dict[str, str]:
    with ThreadPoolExecutor(max_workers=min(8, max(1, len(rel_paths)))) as pool:
        digests = pool.map(lambda rel: sha256_of(os.path.join(folder, rel)), rel_paths)
        return dict(zip(rel_paths, digests))


def write_manifest(folder: str) -> dict:
    """Describe every file under `folder` in `folder/manifest.json` (atomically, synced); returns the entries."""
    rel_paths = _files_under(folder)
    digests = _hash_all(folder, rel_paths)
    files = {rel: {"size": os.path.getsize(os.path.join(folder, rel)), "sha256": digests[rel]} for rel in rel_paths}
    text = json.dumps({"format": FORMAT, "files": files}, indent=1, sort_keys=True)
    write_file_atomically(os.path.join(folder, MANIFEST), lambda f: f.write(text.encode()))
    return files


def read_manifest(folder: str) -> dict:
    """The manifest's file entries; raises CorruptCheckpointError when it is missing or unreadable."""
    path = os.path.join(folder, MANIFEST)
    if not os.path.isfile(path):
        raise CorruptCheckpointError(
            f"{folder} is not a complete checkpoint: it has no {MANIFEST} (the file a save writes last)"
        )
    try:
        with open(path) as f:
            manifest = json.load(f)
        files = manifest["files"]
        if manifest.get("format") != FORMAT or not isinstance(files, dict):
            raise ValueError(f"format {manifest.get('format')!r}")
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise CorruptCheckpointError(f"{path} is not a valid checkpoint manifest ({e})") from e
    return files


def verify_manifest(folder: str) -> None:
    """Check every file of `folder` against its manifest: sizes first (cheap), then SHA-256 of each file."""
    files = read_manifest(folder)
    present = _files_under(folder)
    for rel, entry in files.items():
        path = os.path.join(folder, rel)
        if not os.path.isfile(path):
            raise CorruptCheckpointError(f"{path} is missing (listed in {os.path.join(folder, MANIFEST)})")
        size = os.path.getsize(path)
        if size != entry["size"]:
            raise CorruptCheckpointError(
                f"{path} is {size} bytes, the manifest says {entry['size']} (truncated or rewritten)"
            )
    unlisted = [rel for rel in present if rel not in files]
    if unlisted:
        raise CorruptCheckpointError(
            f"{os.path.join(folder, unlisted[0])} is not in {os.path.join(folder, MANIFEST)} "
            "(a checkpoint folder holds exactly the files its save wrote)"
        )
    digests = _hash_all(folder, sorted(files))
    for rel in sorted(files):
        if digests[rel] != files[rel]["sha256"]:
            raise CorruptCheckpointError(
                f"{os.path.join(folder, rel)} does not match its SHA-256 in "
                f"{os.path.join(folder, MANIFEST)} (corrupted)"
            )
