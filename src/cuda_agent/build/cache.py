"""A content-keyed store of compiled translation units (objects and the glue's precompiled header),
shared by every build on a machine and, through a shared cache directory, across machines.

Layout under ``<cache_dir>/objects``::

    ab/abcdef.../            one entry per key (a directory, published by one rename)
        object               the compiler's output (.o, or the .gch of the precompiled header)
        record.json          unit, key, size, sha256, compile seconds, compiler output, who made it
    locks/abcdef....lock     flock'd while one build compiles that key
    tmp/                     entries being staged (same file system, so the rename is atomic)

Why entries are directories: ``rename(staged_dir, entry)`` fails when ``entry`` already exists, so the
first complete entry wins and the object and its record always come from the same compile; no reader
can see an object without its record or a record of another compile's object. A reader still checks
the object's size (and, for objects, its sha256) against the record before use, so an entry damaged
afterwards (a full disk, a half-copied network share) is recompiled rather than linked.

Why the bytes are copied, never linked: the compiler writes its output inside a build sandbox, and a
file a sandbox could write (or still holds open, or reaches through another link) must never be the
shared entry. ``publish`` runs after the compiler has exited, copies the bytes into a file of its own,
hashes that copy, and renames it into place, so what the record's sha256 covers is what every later
build links. ``place`` hard-links an entry into a build's work directory only where every sandbox of
that build sees it read-only (see builder.py).

Namespaces: the symbol audit's probe extension is built into a cache of its own (``probe/`` beside
``objects/``), which candidate builds may read (``seed``) but never publish to, so nothing a candidate
compiles can stand in for an object the audit's allowlist is read from.

Why a lock as well: two builds of the same unit at once would both compile and one would throw its
object away; the lock makes the second wait for the first and reuse its object. The lock is only an
economy. Correctness rests on the rename, so where flock does not work (some network file systems) or
a holder takes too long, the waiter compiles on its own and the first rename still wins.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import shutil
import socket
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

# Hashing a 500 MB precompiled header on every lookup would cost a second; objects (1-5 MB) are hashed.
HASH_LIMIT_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class CachedObject:
    key: str
    path: Path
    record: dict[str, Any]


class ObjectCache:
    """``seed``: a read-only cache consulted after this one misses (the probe's namespace, whose
    objects every candidate build may reuse but never writes)."""

    def __init__(self, root: Path, seed: "ObjectCache | None" = None):
        self.root = Path(root)
        self.seed = seed

    def entry(self, key: str) -> Path:
        return self.root / key[:2] / key

    def lookup(self, key: str) -> CachedObject | None:
        """The published object of ``key`` when its record and bytes agree (here, else in ``seed``);
        None otherwise."""
        found = self._lookup(key)
        if found is None and self.seed is not None:
            found = self.seed.lookup(key)
        return found

    def _lookup(self, key: str) -> CachedObject | None:
        entry = self.entry(key)
        try:
            record = json.loads((entry / "record.json").read_text())
        except (OSError, ValueError):
            return None
        path = entry / "object"
        try:
            size = path.stat().st_size
        except OSError:
            return None
        if record.get("key") != key or size != record.get("bytes"):
            return None
        if size <= HASH_LIMIT_BYTES and _sha256(path) != record.get("sha256"):
            return None
        return CachedObject(key, path, record)

    def publish(self, key: str, produced: Path, record: dict[str, Any]) -> CachedObject:
        """Store a copy of ``produced`` under ``key`` (call it only once the process that wrote it has
        exited); when another build published it first, theirs is kept (same key, same inputs) and
        returned. The copy is the evaluator's own file: its sha256 is taken from the copy, never from
        a file a sandbox could still change."""
        tmp_root = self.root / "tmp"
        tmp_root.mkdir(parents=True, exist_ok=True)
        staged = Path(tempfile.mkdtemp(prefix=key[:16] + "-", dir=tmp_root))
        try:
            shutil.copyfile(produced, staged / "object")
            with open(staged / "object", "rb") as f:
                os.fsync(f.fileno())
            size = (staged / "object").stat().st_size
            full = dict(record, key=key, bytes=size, sha256=_sha256(staged / "object"), created=time.time(),
                        host=socket.gethostname())
            with open(staged / "record.json", "w") as f:
                json.dump(full, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            entry = self.entry(key)
            entry.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.rename(staged, entry)
            except OSError as exc:
                if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                    raise
                existing = self._lookup(key)
                if existing is not None:
                    return existing
                # A damaged entry: move it aside (a rename, so a concurrent reader sees old or none)
                # and publish ours in its place.
                aside = Path(tempfile.mkdtemp(prefix="damaged-", dir=tmp_root))
                try:
                    os.rename(entry, aside / "entry")
                except OSError:
                    pass
                shutil.rmtree(aside, ignore_errors=True)
                try:
                    os.rename(staged, entry)
                except OSError:
                    pass
            published = self._lookup(key)
            if published is None:
                raise OSError(f"the object cache at {self.root} did not keep {key}; check that the directory is writable "
                              "and the disk not full.")
            return published
        finally:
            shutil.rmtree(staged, ignore_errors=True)

    @contextmanager
    def lock(self, key: str, wait_s: float) -> Iterator[bool]:
        """Hold the key's lock for a compile; yields whether it was acquired (False: waited ``wait_s``
        or the file system refuses flock; the caller compiles anyway, safely)."""
        locks = self.root / "locks"
        locks.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(locks / f"{key}.lock", os.O_RDWR | os.O_CREAT, 0o666)
        except OSError:
            yield False
            return
        acquired = False
        try:
            deadline = time.monotonic() + wait_s
            delay = 0.02
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    acquired = True
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        break
                    time.sleep(delay)
                    delay = min(delay * 2, 0.25)
                except OSError:
                    break  # flock unsupported here: rely on the atomic publish alone
            yield acquired
        finally:
            if acquired:
                fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def place(self, cached: CachedObject, target: Path) -> None:
        """Put the cached object at ``target`` for the compiler or linker: a hard link (no copy; the
        sandbox may not see the cache directory itself, e.g. under a private /tmp). ``target`` must lie
        where every sandbox sees it read-only: a link is the entry itself."""
        target.parent.mkdir(parents=True, exist_ok=True)
        _link_or_copy(cached.path, target)


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
