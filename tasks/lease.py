"""One writer per cohort store: a lease file beside the store, taken before any write.

Two ``gpmil run`` on one store used to interleave their commits (dropped slides, staging groups
marked complete without their features). Every stage that writes a store (ingest, training
checkpoints, predictions) now holds :func:`writer_lease` for it:

- The lease is the file ``<store>.writer-lease.json`` (beside the store, so Zarr never sees it),
  created with ``O_CREAT | O_EXCL``: of two writers exactly one gets it. It records the host, PID
  (and the process start time, so a reused PID is not mistaken for the holder), what is writing,
  when it started, and a random token.
- A second writer meets :class:`StoreLockedError` at once, naming the holder and what to do.
- The holder refreshes the file's modification time every ``ttl / 4`` seconds (a daemon thread).
  A lease is **stale**, and the next writer takes it over (logging that it did), when its holder is
  a process on this host that no longer exists, or when it has not been refreshed for ``ttl``
  seconds (default 15 minutes; the only test possible for a holder on another host).
- Within one process the lease is shared (re-entrant): the flow and the library functions it
  calls may each take it. Readers never look at it.
- Deleting the file by hand releases a lease whose holder is known to be gone.

Readers of a folder that another process may remove (a model that ``keep_runs`` prunes) hold
:func:`reader_lease` instead: any number at once, each a file in ``<folder>/.readers/``, refreshed
and judged stale by the same rules; the remover holds the folder's writer lease while it reads
them (:func:`live_readers`) and removes.
"""

from __future__ import annotations

import functools
import inspect
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

__all__ = ["DEFAULT_TTL_S", "StoreLockedError", "LeaseInfo", "lease_path", "writer_lease", "read_lease", "holds_writer_lease",
           "ensure_still_held", "READERS", "reader_lease", "live_readers"]

log = logging.getLogger("gpmil.lease")

DEFAULT_TTL_S = 900.0
_UNREADABLE_GRACE_S = 30.0
_HELD: dict[str, list] = {}  # lease path -> [token, depth, stop event] for leases this process holds
_HELD_LOCK = threading.Lock()


class StoreLockedError(RuntimeError):
    """Another live process is writing the store."""


@dataclass(frozen=True)
class LeaseInfo:
    host: str
    pid: int
    pid_start: str | None
    purpose: str
    started: float
    token: str


def lease_path(store: str | Path) -> Path:
    """``<store>.writer-lease.json``, beside the store directory."""
    store = Path(store).resolve()
    return store.with_name(store.name + ".writer-lease.json")


def _process_start(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (Linux ``/proc``), or None elsewhere."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def _alive(pid: int, pid_start: str | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return pid_start is None or _process_start(pid) in (None, pid_start)


def read_lease(store: str | Path) -> tuple[LeaseInfo, float] | None:
    """The current lease of ``store`` and the seconds since it was last refreshed, or None."""
    return _read_lease_file(lease_path(store))


def _read_lease_file(path: Path) -> tuple[LeaseInfo, float] | None:
    """A lease file's holder and the seconds since it was last refreshed; None if it is not there."""
    record = _read_lease_record(path)
    return None if record is None else record[:2]


def _read_lease_record(path: Path) -> tuple[LeaseInfo, float, tuple[int, int]] | None:
    """:func:`_read_lease_file` and which file it was (inode and modification time, from the one
    open file read: two unreadable leases read alike, a deleted file's inode is soon reused, and a
    lease refreshed since it was read is no longer the one judged)."""
    try:
        with open(path, "rb") as file:
            status = os.fstat(file.fileno())
            text = file.read()
    except FileNotFoundError:
        return None
    try:
        info = LeaseInfo(**json.loads(text))
    except (ValueError, TypeError):  # a half-written or foreign file: treat as refreshed at its mtime
        info = LeaseInfo(host="?", pid=-1, pid_start=None, purpose="unreadable lease file", started=0.0, token="?")
    return info, time.time() - status.st_mtime, (status.st_ino, status.st_mtime_ns)


def _stale_reason(info: LeaseInfo, age: float, ttl: float) -> str | None:
    if info.pid == -1 and age > _UNREADABLE_GRACE_S:
        return f"the lease file is unreadable and {age:.0f} s old (a writer killed while creating it)"
    if info.host == socket.gethostname() and info.pid > 0 and not _alive(info.pid, info.pid_start):
        return f"its process {info.pid} on {info.host} no longer runs"
    if age > ttl:
        return f"it was last refreshed {age:.0f} s ago (more than {ttl:.0f} s)"
    return None


def _try_create(path: Path, record: LeaseInfo | bytes) -> bool:
    """Make the lease file ``path`` holding ``record`` unless a file is there (``O_EXCL``)."""
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "wb") as f:
        f.write(record if isinstance(record, bytes) else json.dumps(asdict(record)).encode())
        f.flush()
        os.fsync(f.fileno())
    return True


def _this_process(purpose: str) -> LeaseInfo:
    """A new lease's record: this host and process, ``purpose``, now, a random token."""
    pid = os.getpid()
    return LeaseInfo(socket.gethostname(), pid, _process_start(pid), purpose, time.time(), uuid.uuid4().hex)


def _acquire(store: str | Path, purpose: str, ttl: float) -> LeaseInfo:
    path = lease_path(store)
    path.parent.mkdir(parents=True, exist_ok=True)  # a new store's folder may not exist yet (the first ingest creates it)
    info = _this_process(purpose)
    for _ in range(5):
        if _try_create(path, info):
            return info
        current = _read_lease_record(path)
        for _ in range(20):  # a lease just created, its record not yet written: read it once it is
            if current is None or current[0].pid != -1 or current[1] > 1.0:
                break
            time.sleep(0.05)
            current = _read_lease_record(path)
        if current is None:
            continue  # released between our attempt and the read: try again
        holder, age, judged = current  # judged: which file was read
        reason = _stale_reason(holder, age, ttl)
        if reason is None:
            raise StoreLockedError(
                f"{store} is being written by another run: {holder.purpose} (host {holder.host}, PID {holder.pid}, since "
                f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(holder.started))}, refreshed {age:.0f} s ago). "
                f"Wait for it to finish; a lease whose process is gone is taken over automatically (dead PID on this "
                f"host, or no refresh for {ttl:.0f} s). Lease file: {path}")
        # Move the stale lease aside (atomic; of several writers taking it over, one rename wins).
        aside = path.with_name(f"{path.name}.stale-{info.token}")
        try:
            os.rename(path, aside)
        except FileNotFoundError:
            continue
        moved = _read_lease_record(aside)
        if moved is not None and (moved[0].token != holder.token or moved[2] != judged):
            _put_back(aside, path)  # another taker renamed the stale one first and made its lease since: not ours to move
            continue
        aside.unlink(missing_ok=True)
        log.warning("took over the writer lease of %s: %s (%s)", store, reason, holder.purpose)
    raise StoreLockedError(f"{store}: could not take the writer lease {path} (it keeps changing hands)")


def _put_back(aside: Path, path: Path) -> None:
    """Return a live lease moved aside by mistake to ``path`` (a new file of the same record, made
    only if no lease is there again: that holder's next check then finds its lease lost)."""
    _try_create(path, aside.read_bytes())
    aside.unlink(missing_ok=True)


def _keep_refreshed(path: Path, token: str, ttl: float) -> threading.Event:
    """Refresh the lease file every ``ttl / 4`` s in a daemon thread until the returned event is set."""
    stop = threading.Event()
    threading.Thread(target=_refresh, args=(path, token, stop, ttl / 4), daemon=True, name=f"lease-{path.name}").start()
    return stop


def _refresh(path: Path, token: str, stop: threading.Event, every: float) -> None:
    """Touch the lease file every ``every`` s until ``stop``; a failure to read or touch it (a
    network file system's hiccup, the file gone for a moment while another run puts it back) is
    tried again at the next tick, a lease taken over ends it."""
    while not stop.wait(every):
        try:
            if json.loads(path.read_text()).get("token") != token:
                log.error("the lease %s was taken over by another process", path)
                return
            os.utime(path)
        except FileNotFoundError:
            log.warning("the lease %s is not there; looking again at the next refresh", path)
        except (OSError, ValueError) as error:
            log.warning("could not refresh the lease %s (%s: %s); trying again", path, type(error).__name__, error)


@contextmanager
def writer_lease(store: str | Path, purpose: str, *, ttl: float = DEFAULT_TTL_S) -> Iterator[None]:
    """Hold the store's writer lease for the block (re-entrant within this process)."""
    path = lease_path(store)
    key = str(path)
    with _HELD_LOCK:
        held = _HELD.get(key)
        if held is not None:
            held[1] += 1
        else:
            info = _acquire(store, purpose, ttl)
            held = _HELD[key] = [info.token, 1, _keep_refreshed(path, info.token, ttl)]
    try:
        yield
    finally:
        with _HELD_LOCK:
            held[1] -= 1
            if held[1] == 0:
                del _HELD[key]
                held[2].set()
                current = read_lease(store)
                if current is not None and current[0].token == held[0]:
                    path.unlink(missing_ok=True)


def ensure_still_held(store: str | Path) -> None:
    """Before a commit: if this process holds the store's lease, check nobody took it over (a
    holder frozen for longer than the ttl); raise rather than write beside another writer."""
    path = lease_path(store)
    with _HELD_LOCK:
        held = _HELD.get(str(path))
    if held is None:
        return
    current = read_lease(store)
    if current is None or current[0].pid == -1:  # gone, or not yet written, for a moment while another run
        time.sleep(0.2)                           # puts back the lease it moved by mistake
        current = read_lease(store)
    if current is None or current[0].token != held[0]:
        holder = "nobody" if current is None else f"{current[0].purpose} (host {current[0].host}, PID {current[0].pid})"
        raise StoreLockedError(f"the writer lease of {store} was lost while this run held it (now: {holder}); "
                               "stopping before the next commit. Rerun: what is staged is committed then.")


def holds_writer_lease(purpose: str) -> Callable[[Callable], Callable]:
    """Decorator: the function holds the writer lease of its ``store`` argument while it runs;
    ``purpose`` is formatted with the call's arguments (``"training run {run!r}"``)."""
    def decorate(function: Callable) -> Callable:
        signature = inspect.signature(function)

        @functools.wraps(function)
        def wrapper(*args, **kwargs):
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            with writer_lease(bound.arguments["store"], purpose.format(**bound.arguments)):
                return function(*args, **kwargs)

        return wrapper

    return decorate


READERS = ".readers"
"""The folder, inside a folder being read, of its readers' lease files."""

_REMOVAL_WAIT_S = 60.0


@contextmanager
def reader_lease(folder: str | Path, purpose: str, *, ttl: float = DEFAULT_TTL_S) -> Iterator[None]:
    """Mark ``folder`` as read by this process for the block: ``<folder>/.readers/<token>.json``,
    refreshed every ``ttl / 4`` s, removed at the end.

    A remover takes the folder's :func:`writer_lease`, then reads the readers (:func:`live_readers`)
    and removes the folder only if there are none. A reader makes its file, then waits while a
    remover holds that lease: made before the remover looked, its file stops the removal; made
    after, the remover's lease was there before it, so the reader waits for the decision and meets
    a folder that is gone (FileNotFoundError), never one that goes while it reads."""
    folder = Path(folder)
    readers = folder / READERS
    readers.mkdir(exist_ok=True)
    info = _this_process(purpose)
    path = readers / f"{info.token}.json"
    if not _try_create(path, info):
        raise FileExistsError(path)  # a random token: never in practice
    try:
        _wait_out_a_removal(folder, ttl)
        stop = _keep_refreshed(path, info.token, ttl)
        try:
            yield
        finally:
            stop.set()
    finally:
        path.unlink(missing_ok=True)


def _wait_out_a_removal(folder: Path, ttl: float) -> None:
    """While a live process holds ``folder``'s writer lease (a removal deciding), wait; then raise
    FileNotFoundError if the folder went."""
    deadline = time.monotonic() + _REMOVAL_WAIT_S
    while (current := read_lease(folder)) is not None and _stale_reason(*current, ttl) is None:
        if time.monotonic() > deadline:
            holder = current[0]
            raise StoreLockedError(f"{folder} is held by {holder.purpose} (host {holder.host}, PID {holder.pid}) for more "
                                   f"than {_REMOVAL_WAIT_S:.0f} s; try again")
        time.sleep(0.05)
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder} was removed as this reader came")


def live_readers(folder: str | Path, *, ttl: float = DEFAULT_TTL_S) -> list[str]:
    """What holds a :func:`reader_lease` on ``folder`` now (``purpose (host, PID)``): on this host,
    lease files whose process runs, however long it reads; from another host, those refreshed
    within ``ttl``. FileNotFoundError if the folder is not there."""
    if not Path(folder).is_dir():
        raise FileNotFoundError(f"{folder} is not there")
    live = []
    for path in sorted((Path(folder) / READERS).glob("*.json")):
        if (current := _read_lease_file(path)) is None:
            continue  # released while we looked
        info, age = current
        here = info.host == socket.gethostname() and info.pid > 0
        if _alive(info.pid, info.pid_start) if here else _stale_reason(info, age, ttl) is None:
            live.append(f"{info.purpose} (host {info.host}, PID {info.pid})")
    return live
