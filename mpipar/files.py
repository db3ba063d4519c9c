"""Writing files atomically: to a temporary name in the same folder, then a rename over the target.

A leaf module (standard library only; h5py imported when an HDF5 file is written). Readers, and
other ranks writing the same file at once, only ever see a whole file: ``os.replace`` within one
folder is atomic, and a crash or an error mid-write leaves the old file (or none) and no
temporary. This is the single implementation; the timing dump, checkpoints, token files and
JSON summaries all go through it.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import time
from contextlib import contextmanager

# a temporary older than this is the leftover of a crashed write (a live writer keeps touching
# its file), and is removed by the next write of the same target
STALE_AFTER_S = 3600.0


def _umask() -> int:
    mask = os.umask(0o022)  # reading the umask means setting it; put it straight back
    os.umask(mask)
    return mask


def _temp_name_pattern(path: str):
    """The names ``atomic_path`` gives temporaries of ``path``: ``.NAME.XXXXXXXX.tmp``."""
    return re.compile(re.escape(f".{os.path.basename(path)}.") + r"[A-Za-z0-9_]{8}\.tmp")


def remove_stale_temporaries(path, older_than_s: float = STALE_AFTER_S) -> list:
    """Remove the temporaries that crashed writes of ``path`` left beside it (only this module's
    own pattern, only those untouched for ``older_than_s``). Returns the removed paths."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    pattern, now, removed = _temp_name_pattern(path), time.time(), []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        full = os.path.join(directory, name)
        try:
            if pattern.fullmatch(name) and now - os.stat(full).st_mtime > older_than_s:
                os.unlink(full)
                removed.append(full)
        except OSError:
            pass  # another process removed or replaced it first
    return removed


def _fsync_dir(directory: str) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return  # some systems cannot open a directory; the rename is still atomic
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextmanager
def atomic_path(path, durable: bool = False):
    """Yield a fresh temporary path beside ``path``; when the block ends normally, rename it over
    ``path`` (after an ``fsync`` if ``durable``: the bytes reach the disk before the rename
    publishes them, and the folder after it). On any error the temporary is removed and the error
    re-raised. The file gets the permissions of an ordinary new file under the umask (``mkstemp``
    alone would make it 0600, unreadable by the group on a shared cluster), and temporaries of
    earlier crashed writes of ``path`` are removed."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    remove_stale_temporaries(path)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp",
                                   dir=directory)
    except OSError as exc:  # name the user's path, not the temporary nobody asked for
        raise write_error(path, exc) from None
    try:
        os.fchmod(fd, 0o666 & ~_umask())
    finally:
        os.close(fd)
    try:
        yield tmp
        if durable:
            with open(tmp, "rb+") as fh:
                os.fsync(fh.fileno())
        os.replace(tmp, path)
        if durable:
            _fsync_dir(directory)
    except BaseException as exc:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(exc, OSError) and not getattr(exc, "written", False):
            raise write_error(path, exc) from None
        raise


def _parents(folder: str):
    while True:
        yield folder
        up = os.path.dirname(folder)
        if up == folder:
            return
        folder = up


def write_error(path, exc: BaseException) -> OSError:
    """An OSError naming ``path`` (what the user asked for) and what to do, for a failed write
    (a read-only or missing folder, a full disk, a quota)."""
    why = getattr(exc, "strerror", None) or " ".join(str(exc).split())
    folder = os.path.dirname(os.path.abspath(os.fspath(path)))
    parent = next((p for p in _parents(folder) if os.path.lexists(p)), folder)
    if not os.path.isdir(parent):
        why = f"{parent} is a file, not a folder"
    err = OSError(f"could not write {os.fspath(path)}: {why}; check that {folder} exists, "
                  f"is writable and has free space, or choose another location")
    err.errno, err.written = getattr(exc, "errno", None), True  # said once, not re-wrapped
    return err


@contextmanager
def atomic_h5(path, durable: bool = False, in_memory: bool = False):
    """An h5py File open for writing at a temporary name beside ``path``, renamed over ``path``
    only when the block ends normally: a crash or an error never leaves a half-written file.

    ``in_memory``: the file is built in memory and its bytes written with plain file I/O, so a
    full disk or a quota is an ``OSError`` naming ``path``. (HDF5 itself reports a failed write
    from inside an object's deallocation, through ``sys.excepthook``, and may crash closing the
    file after it.) For files whose contents are in memory anyway: checkpoints, token files."""
    import h5py

    with atomic_path(path, durable) as tmp:
        if not in_memory:
            with h5py.File(tmp, "w") as f:
                yield f
            return
        with h5py.File(tmp, "w", driver="core", backing_store=False) as f:
            yield f
            f.flush()
            image = f.id.get_file_image()
        with open(tmp, "wb") as fh:
            fh.write(image)


def write_text_atomic(path, text: str, durable: bool = False) -> None:
    """Write ``text`` to ``path``, atomically (``durable``: fsync before the rename)."""
    with atomic_path(path, durable) as tmp:
        with open(tmp, "w") as fh:
            fh.write(text)


def write_json_atomic(path, obj) -> None:
    """Write ``obj`` as indented JSON (NumPy scalars as floats) to ``path``, atomically."""
    write_text_atomic(path, json.dumps(obj, indent=2, default=float) + "\n")


def check_writable(path, what: str = "the timing dump",
                   fix: str = "pass --out DIR with a writable directory") -> None:
    """Fail early (before the work) if ``what`` cannot be written at ``path``: ``ValueError``
    naming it and saying ``fix``.

    Probes by creating and deleting a file next to ``path``: permission bits lie for root and
    on some network file systems.
    """
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    why = None
    if os.path.isdir(path):
        why = "it is a directory"
    elif not os.path.isdir(directory):
        why = f"directory {directory} does not exist"
    else:
        try:
            fd, probe = tempfile.mkstemp(prefix=".mpipar-probe.", dir=directory)
            os.close(fd)
            os.unlink(probe)
        except OSError as exc:
            why = exc.strerror or str(exc)
    if why is not None:
        raise ValueError(f"cannot write {what} to {path}: {why}; {fix}")
