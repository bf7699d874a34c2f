"""One lock a pair, so that two processes never run the same pair at once.

A lock is a small JSON file (``<batch>/.locks/<pair_id>.lock``) created exclusively and
holding the host, the process id, the start time and a heartbeat that a thread of the holder
rewrites every :data:`HEARTBEAT` seconds, with the holder's resident memory, read every
:data:`MEMORY_SAMPLE` seconds and written at once when it grows by a tenth: the last reading
before a worker dies tells an out-of-memory kill from other crashes. A lock is stale, and
broken by the next process that wants it, when its holder is a dead (or zombie) process of
this host, or when its heartbeat is older than :data:`STALE_AFTER` seconds (a holder on
another host, or a hung one): killed jobs never block a rerun.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from pathlib import Path

__all__: list[str] = []

#: Seconds between two heartbeats of a lock's holder.
HEARTBEAT = 10.0
#: A lock whose heartbeat is older than this (seconds) is stale.
STALE_AFTER = 120.0
#: Seconds between two readings of the holder's resident memory.
MEMORY_SAMPLE = 0.25


class LockedError(RuntimeError):
    """The pair is being run by a live process (its lock is fresh)."""


def lock_path(folder: str | Path, pair_id: str) -> Path:
    """Where a pair's lock lives in a batch folder."""
    return Path(folder) / ".locks" / f"{pair_id}.lock"


def read_lock(path: Path) -> dict | None:
    """The lock's content, or None if there is no lock (or it is unreadable: a lock being
    written, or the remains of a killed write, which count as stale)."""
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def _alive(pid: int) -> bool:
    """Whether process ``pid`` of this host runs: not gone, and not a zombie (killed, not
    yet reaped by its parent: it holds its pid but runs nothing)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    try:
        import psutil

        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except Exception:  # psutil missing, or the process ended meanwhile
        return True


def is_stale(doc: dict | None, now: float | None = None) -> bool:
    """Whether a lock's holder is gone (see the module docstring)."""
    if doc is None:
        return True
    now = time.time() if now is None else now
    if now - float(doc.get("heartbeat", 0)) > STALE_AFTER:
        return True
    return doc.get("host") == socket.gethostname() and not _alive(int(doc.get("pid", -1)))


def _rss_mb() -> float | None:
    try:
        import psutil

        return psutil.Process().memory_info().rss / 2**20
    except Exception:  # pragma: no cover - psutil missing or /proc unreadable
        return None


class PairLock:
    """``with PairLock(batch_folder, pair_id):`` runs the body holding the pair's lock.

    Raises:
        LockedError: a live process holds it.
    """

    def __init__(self, folder: str | Path, pair_id: str) -> None:
        self.path = lock_path(folder, pair_id)
        self.token = uuid.uuid4().hex
        self.broke: dict | None = None  # the stale lock this one replaced, if any
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._rss: float | None = None  # the last memory reading written

    def _doc(self, rss: float | None = None) -> dict:
        self._rss = _rss_mb() if rss is None else rss
        return {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "token": self.token,
            "started": self._started,
            "heartbeat": time.time(),
            "rss_mb": self._rss,
        }

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._started = time.time()
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                doc = read_lock(self.path)
                if doc is None and time.time() - _mtime(self.path) < 5:
                    time.sleep(0.2)  # being written right now
                    continue
                if not is_stale(doc):
                    raise LockedError(
                        f"pair lock {self.path} is held by pid {doc.get('pid')} on "
                        f"{doc.get('host')} (heartbeat {time.time() - doc['heartbeat']:.0f} s "
                        "ago)"
                    ) from None
                self.broke = doc or {}
                _break(self.path)
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(self._doc(), f)
            self._thread = threading.Thread(target=self._beat, daemon=True, name="otreg-lock")
            self._thread.start()
            return
        raise LockedError(f"pair lock {self.path} could not be taken (contended)")

    def _beat(self) -> None:
        last = time.monotonic()
        while not self._stop.wait(MEMORY_SAMPLE):
            rss = _rss_mb()
            grew = rss is not None and self._rss is not None and rss > 1.1 * self._rss
            if grew or time.monotonic() - last >= HEARTBEAT:
                self.write(rss)
                last = time.monotonic()

    def write(self, rss: float | None = None) -> None:
        """Rewrite the heartbeat now (atomically), if the lock is still ours, with the memory
        reading ``rss`` (MB; read now if None)."""
        doc = read_lock(self.path)
        if doc is not None and doc.get("token") != self.token:
            return
        tmp = self.path.with_name(f".{self.path.name}.{self.token}.tmp")
        tmp.write_text(json.dumps(self._doc(rss)))
        os.replace(tmp, self.path)

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        doc = read_lock(self.path)
        if doc is not None and doc.get("token") == self.token:
            self.path.unlink(missing_ok=True)

    def __enter__(self) -> PairLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def _break(path: Path) -> None:
    """Remove a stale lock; renamed first so that two breakers do not remove a new lock."""
    broken = path.with_name(f".{path.name}.broken-{uuid.uuid4().hex}")
    try:
        os.replace(path, broken)
    except FileNotFoundError:
        return
    broken.unlink(missing_ok=True)
