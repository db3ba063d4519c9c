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
import tempfile
from contextlib import contextmanager


@contextmanager
def atomic_path(path, durable: bool = False):
    """Yield a fresh temporary path beside ``path``; when the block ends normally, rename it over
    ``path`` (after an ``fsync`` if ``durable``: the bytes reach the disk before the rename
    publishes them). On any error the temporary is removed and the error re-raised."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=directory)
    os.close(fd)
    try:
        yield tmp
        if durable:
            with open(tmp, "rb+") as fh:
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


@contextmanager
def atomic_h5(path, durable: bool = False):
    """An h5py File open for writing at a temporary name beside ``path``, renamed over ``path``
    only when the block ends normally: a crash or an error never leaves a half-written file."""
    import h5py

    with atomic_path(path, durable) as tmp:
        with h5py.File(tmp, "w") as f:
            yield f


def write_text_atomic(path, text: str) -> None:
    """Write ``text`` to ``path``, atomically."""
    with atomic_path(path) as tmp:
        with open(tmp, "w") as fh:
            fh.write(text)


def write_json_atomic(path, obj) -> None:
    """Write ``obj`` as indented JSON (NumPy scalars as floats) to ``path``, atomically."""
    write_text_atomic(path, json.dumps(obj, indent=2, default=float) + "\n")


def check_writable(path) -> None:
    """Fail early (before training) if the dump cannot be written where asked.

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
        raise ValueError(
            f"cannot write the timing dump to {path}: {why}; "
            f"pass --out DIR with a writable directory"
        )
