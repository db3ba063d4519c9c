"""HDF5 checkpoints of full (unsharded) tensors, which load onto any grid.

Layout (format_version 2):

- ``/params/<parameter name>``: the full-shape parameter, in the run's dtype;
- ``/optim/<parameter name>/<buffer>``: the optimizer state of that parameter, full shape
  (``exp_avg``, ``exp_avg_sq`` for AdamW; ``momentum_buffer`` for SGD);
- each dataset has the attribute ``sha256``: the hex SHA-256 of its bytes (C order, stored dtype);
- attributes: ``format_version``, ``step`` (steps completed), ``optimizer``, ``optimizer_step``,
  ``config`` (JSON), ``grid`` (JSON, of the run that saved it), ``dtype``, ``complete``.

Saving gathers each tensor over tp (its shard axis), then each stage's tensors to world rank 0,
which writes ``step_NNNNNN.h5`` through a temporary file, ``fsync`` and ``os.replace``
(``files.atomic_h5``): a crash mid-write leaves the previous checkpoint and no half-written file.
``latest`` names the newest one.
Loading: every rank reads the file and verifies every tensor's checksum (a flipped byte is
refused, naming the tensor), checks that the names are exactly the model's (missing and unknown
tensors are refused, named) and every shape, before changing anything; then takes its own shard,
so a run saved at dp2 pp2 tp2 resumes at dp1 pp4 tp2 or on one rank. Since batches depend only
on (seed, step), resuming is exact. Version 1 files (no checksums) still load, with a warning
that their bytes cannot be verified.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import numpy as np

from .backend import to_numpy
from .files import atomic_h5, write_text_atomic
from .nn.params import assemble, take_shard

FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)  # 1: no checksums (loaded with a warning)


class CheckpointError(ValueError):
    pass


# ----- packing named arrays into bytes (for the gather to rank 0; no pickling) ----------------

def pack_arrays(arrays: dict) -> bytes:
    header, chunks = [], []
    for name, a in arrays.items():
        a = np.ascontiguousarray(a)
        header.append([name, list(a.shape), a.dtype.str])
        chunks.append(a.tobytes())
    h = json.dumps(header).encode()
    return len(h).to_bytes(8, "little") + h + b"".join(chunks)


def unpack_arrays(blob: bytes) -> dict:
    n = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8:8 + n])
    out, off = {}, 8 + n
    for name, shape, dt in header:
        dtype = np.dtype(dt)
        size = int(np.prod(shape)) * dtype.itemsize
        out[name] = np.frombuffer(blob[off:off + size], dtype=dtype).reshape(shape)
        off += size
    return out


# ----- save -----------------------------------------------------------------------------------

def _gather_full(tensor, spec, tp_comm):
    if spec.split:  # 2D / 2.5D / 3D: every rank's block, placed by the spec
        shards = to_numpy(tp_comm.allgather(tensor[None], axis=0))
        return assemble(shards, spec, _full_shape(spec, tensor.shape))
    if spec.axis is None or tp_comm.size == 1:
        return to_numpy(tensor)
    return to_numpy(tp_comm.allgather(tensor, axis=spec.axis))


def _full_shape(spec, shard_shape):
    shape = list(shard_shape)
    for ax, d in spec.split:
        shape[ax] *= spec.grid[d]
    return tuple(shape)


def _optimizer_state_by_param(trainer) -> dict:
    sd = trainer.opt.state_dict()
    buffers = [k for k in next(iter(sd.values())) if k != "step"] if sd else []
    if trainer.sync.zero1:
        state = {k: v for k, v in sd.items()}
        return trainer.sync.gather_state(state, buffers), buffers
    return {name: {b: e[b] for b in buffers} for name, e in sd.items()}, buffers


def gather_full(trainer, what=("params", "optim")) -> dict | None:
    """Collective over the world: {"params/NAME": full array, "optim/NAME/BUF": ..., "grads/NAME":
    ...} on world rank 0 (None elsewhere), gathered over tp (shard axes) and pp (stages)."""
    g = trainer.grid
    tensors = {}
    older = None
    if "optim" in what:
        opt_state, buffers = _optimizer_state_by_param(trainer)
        older = trainer.older_weights() if hasattr(trainer, "older_weights") else None
    for p in trainer.params:
        if older is not None:  # PipeDream-2BW's older weight buffer
            tensors[f"older/{p.name}"] = _gather_full(older[p.name], p.spec, g.tp_comm)
        if "params" in what:
            tensors[f"params/{p.name}"] = _gather_full(p.data, p.spec, g.tp_comm)
        if "grads" in what:
            tensors[f"grads/{p.name}"] = _gather_full(p.grad, p.spec, g.tp_comm)
        if "optim" in what:
            for b in buffers:
                tensors[f"optim/{p.name}/{b}"] = _gather_full(opt_state[p.name][b], p.spec,
                                                              g.tp_comm)
    # one copy per stage (dp 0, tp 0) goes to world rank 0 over the pipeline communicator
    blobs = None
    if g.dp_rank == 0 and g.tp_rank == 0:
        blobs = g.pp_comm.gather_bytes(pack_arrays(tensors), root=0)
    if g.rank != 0:
        return None
    merged = {}
    for blob in blobs:
        merged.update(unpack_arrays(blob))
    return merged


def save_checkpoint(trainer, directory) -> Path | None:
    """Collective over the world. Returns the path on world rank 0 (None elsewhere)."""
    g = trainer.grid
    if getattr(trainer, "segment", None) is not None:
        raise CheckpointError("a checkpoint needs a drained pipeline: a continuous schedule is "
                              "in flight (the loop drains before each checkpoint)")
    tensors = gather_full(trainer)
    path = _write(Path(directory), trainer, tensors) if g.rank == 0 else None
    g.world_comm.barrier()
    return path


def _write(directory: Path, trainer, tensors: dict) -> Path:
    path = directory / f"step_{trainer.step:06d}.h5"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        _write_file(path, trainer, tensors)
    except OSError as exc:  # a full disk, a quota: said with the file, `latest` untouched
        raise OSError(f"checkpoint not saved: {exc} (the earlier checkpoints and "
                      f"{directory / 'latest'} are intact)") from None
    write_text_atomic(directory / "latest", path.name + "\n", durable=True)
    return path


def _write_file(path: Path, trainer, tensors: dict) -> None:
    cfg = trainer.cfg
    with atomic_h5(path, durable=True, in_memory=True) as f:
        for name, a in sorted(tensors.items()):
            a = np.ascontiguousarray(a)
            f.create_dataset(name, data=a).attrs["sha256"] = digest(a)
        f.attrs["format_version"] = FORMAT_VERSION
        f.attrs["step"] = trainer.step
        f.attrs["optimizer"] = cfg.train.optimizer
        f.attrs["optimizer_step"] = trainer.opt.step_count
        f.attrs["config"] = cfg.to_json()
        f.attrs["grid"] = json.dumps({"dp": cfg.parallel.dp, "pp": cfg.parallel.pp,
                                      "tp": cfg.parallel.tp})
        f.attrs["dtype"] = cfg.train.dtype
        f.attrs["complete"] = True


# ----- load -----------------------------------------------------------------------------------

def resolve(resume: str, out_dir: Path) -> Path:
    """The checkpoint file ``run.resume`` names: a file, ``latest`` (the run directory's
    ``checkpoints/latest``) or ``auto`` (the same; ``find_resume`` falls back on damage)."""
    if resume in ("latest", "auto"):
        pointer = Path(out_dir) / "checkpoints" / "latest"
        if not pointer.is_file():
            raise CheckpointError(f"run.resume = {resume} but {pointer} does not exist: no "
                                  f"checkpoint was saved in this run directory; drop --resume "
                                  f"or pass --out with the directory of the run to resume")
        try:
            name = pointer.read_text().strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"{pointer} cannot be read ({exc}): pass --resume "
                                  f"{pointer.parent}/step_NNNNNN.h5 instead") from None
        if not name or "/" in name:
            raise CheckpointError(f"{pointer} is {'empty' if not name else 'damaged'} (an "
                                  f"interrupted write?): pass --resume {pointer.parent}/"
                                  f"step_NNNNNN.h5 with the checkpoint to resume, or --resume "
                                  f"auto to take the newest intact one")
        return pointer.parent / name
    return Path(resume)


def _step_files(directory: Path) -> list:
    """The run directory's checkpoint files, newest (highest step) first."""
    return sorted(directory.glob("step_*.h5"), reverse=True)


def digest(a) -> str:
    """The hex SHA-256 of an array's bytes (C order, its own dtype): a tensor's checksum."""
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()


def read_checkpoint(path) -> tuple[dict, dict]:
    """(tensors, attrs) of a checkpoint file, every checksum verified, with clear errors for
    missing, damaged or altered files."""
    import h5py

    path = Path(path)
    if path.is_dir():
        raise CheckpointError(f"run.resume = {path} is a folder: pass a checkpoint file "
                              f"(<run dir>/checkpoints/step_NNNNNN.h5), or --resume latest / "
                              f"auto with --out <run dir>")
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist: check run.resume (--resume "
                              f"auto takes the newest checkpoint of the run directory)")
    try:
        with h5py.File(path, "r") as f:
            attrs = dict(f.attrs)
            version = int(attrs.get("format_version", -1))
            if version not in READABLE_VERSIONS or not attrs.get("complete"):
                raise CheckpointError(f"{path} is not a complete mpipar checkpoint (format "
                                      f"{attrs.get('format_version')}): pick another file")
            tensors, sums = {}, {}

            def visit(name, obj):
                if isinstance(obj, h5py.Dataset):
                    tensors[name] = obj[()]
                    sums[name] = obj.attrs.get("sha256")

            f.visititems(visit)
    except CheckpointError:
        raise
    except Exception as exc:  # h5py raises OSError / KeyError / RuntimeError on damage
        raise CheckpointError(f"checkpoint {path} cannot be read (truncated or corrupted?): "
                              f"{exc}; resume from an earlier checkpoint") from None
    _verify(path, version, tensors, sums)
    return tensors, attrs


def _verify(path, version: int, tensors: dict, sums: dict) -> None:
    if version == 1:
        print(f"mpipar: warning: {path} is a format 1 checkpoint, written without checksums: "
              f"its tensors cannot be verified", file=sys.stderr, flush=True)
        return
    for name in sorted(tensors):
        s = sums[name]
        s = s.decode() if isinstance(s, bytes) else s
        if s is None:
            raise CheckpointError(f"{path}: tensor {name} has no sha256 checksum (format 2 "
                                  f"requires one): the file was altered; resume from another")
        if digest(tensors[name]) != s:
            raise CheckpointError(f"{path}: tensor {name} does not match its sha256 checksum: "
                                  f"the file is corrupted; resume from an earlier checkpoint")


def _names(names) -> str:
    names = sorted(names)
    more = f" and {len(names) - 8} more" if len(names) > 8 else ""
    return ", ".join(names[:8]) + more


def check_contents(path, tensors: dict, shapes: dict, buffers) -> None:
    """The file holds exactly the model's tensors (``shapes``: parameter name -> full shape)
    and optimizer buffers, each of the right shape; else ``CheckpointError`` naming them."""
    expected = {f"params/{n}": s for n, s in shapes.items()}
    tensors = {k: v for k, v in tensors.items() if not k.startswith("older/")}  # load_older
    expected.update({f"optim/{n}/{b}": s for n, s in shapes.items() for b in buffers})
    missing, unknown = set(expected) - set(tensors), set(tensors) - set(expected)
    if missing or unknown:
        parts = ([f"lacks {len(missing)} tensor(s) the model has: {_names(missing)}"]
                 if missing else [])
        parts += ([f"has {len(unknown)} tensor(s) the model does not: {_names(unknown)}"]
                  if unknown else [])
        raise CheckpointError(f"{path} {'; and '.join(parts)}: it was saved from another "
                              f"model (check model.* settings, e.g. n_layer)")
    for key, shape in expected.items():
        if tuple(tensors[key].shape) != tuple(shape):
            raise CheckpointError(f"{path}: tensor {key.split('/')[1]} ({key}) has shape "
                                  f"{tuple(tensors[key].shape)} but the model needs "
                                  f"{tuple(shape)}: the model settings differ from the saved run")


def check_checkpoint(trainer, path) -> tuple[dict, dict]:
    """(tensors, attrs) of ``path``, read, verified and checked against the trainer's model and
    optimizer. No MPI traffic: every rank runs it before the ranks agree (``find_resume``)."""
    tensors, attrs = read_checkpoint(path)
    cfg = trainer.cfg
    if attrs.get("optimizer") != cfg.train.optimizer:
        raise CheckpointError(f"{path} holds {attrs.get('optimizer')} state but the run uses "
                              f"train.optimizer = {cfg.train.optimizer}")
    # the whole model (every stage's tensors), not only this rank's: every rank builds it
    check_contents(path, tensors, {p.name: p.full_shape for p in trainer.model.params()},
                   list(trainer.opt.BUFFERS))
    if _older_names(trainer, tensors):
        for p in trainer.params:
            n = f"older/{p.name}"
            if tuple(tensors[n].shape) != tuple(p.full_shape):
                raise CheckpointError(f"{path}: {n} has shape {tuple(tensors[n].shape)}, the "
                                      f"model needs {tuple(p.full_shape)}")
    return tensors, attrs


def load_into(trainer, path, checked: tuple | None = None) -> int:
    """Load params and optimizer state onto this rank's shards. Returns the step to resume at.
    ``checked``: what ``check_checkpoint`` returned for ``path`` (read here when not given)."""
    tensors, attrs = checked or check_checkpoint(trainer, path)
    buffers = list(trainer.opt.BUFFERS)
    xp = trainer.backend.xp
    for p in trainer.params:
        p.data[...] = xp.asarray(take_shard(tensors[f"params/{p.name}"], p.spec, p.tp_rank,
                                            p.tp_size), dtype=p.data.dtype)
    per_param = {p.name: {b: take_shard(tensors[f"optim/{p.name}/{b}"], p.spec, p.tp_rank,
                                        p.tp_size) for b in buffers} for p in trainer.params}
    if _older_names(trainer, tensors):
        trainer.load_older({p.name: take_shard(tensors[f"older/{p.name}"], p.spec, p.tp_rank,
                                               p.tp_size) for p in trainer.params})
    step = int(attrs["optimizer_step"])
    if trainer.sync.zero1:
        shard_state = trainer.sync.scatter_state(per_param, buffers)
        trainer.opt.load_state_dict({k: dict(v, step=step) for k, v in shard_state.items()})
    else:
        trainer.opt.load_state_dict({k: dict(v, step=step) for k, v in per_param.items()})
    return int(attrs["step"])


def _older_names(trainer, tensors) -> bool:
    """PipeDream-2BW's older buffer is loaded when the run uses one and the file has it (a file
    from a run without it: the older buffer starts equal to the weights, as at step 0)."""
    if not hasattr(trainer, "older_weights") or trainer.older_weights() is None:
        return False
    return all(f"older/{p.name}" in tensors for p in trainer.params)


def find_resume(trainer) -> tuple | None:
    """The checkpoint to resume from, read and checked: (path, (tensors, attrs)), or None when
    ``run.resume`` is empty. No MPI traffic (the caller makes the ranks agree on failure).

    ``run.resume = auto``: a damaged newest checkpoint is named and the newest intact one of
    the same directory taken instead (said in one line by world rank 0)."""
    cfg = trainer.cfg
    if not cfg.run.resume:
        return None
    if cfg.run.resume != "auto":
        path = resolve(cfg.run.resume, cfg.out_dir)
        return path, _within_steps(check_checkpoint(trainer, path), path, cfg)
    directory = Path(cfg.out_dir) / "checkpoints"
    try:
        path = resolve("auto", cfg.out_dir)
        if not path.exists():
            raise CheckpointError(f"{directory / 'latest'} names {path.name}, which does not "
                                  f"exist (deleted?)")
        return path, _within_steps(check_checkpoint(trainer, path), path, cfg)
    except CheckpointError as exc:
        first = exc
    for other in _step_files(directory):
        try:
            checked = check_checkpoint(trainer, other)
        except CheckpointError:
            continue
        if trainer.grid.rank == 0:
            print(f"mpipar: warning: {' '.join(str(first).split())}; resuming from the newest "
                  f"intact checkpoint instead, {other}", file=sys.stderr, flush=True)
        return other, _within_steps(checked, other, cfg)
    raise CheckpointError(f"{first}; no other checkpoint in {directory} is intact: remove "
                          f"that folder (or drop --resume) to start afresh") from None


def _within_steps(checked: tuple, path, cfg) -> tuple:
    step = int(checked[1]["step"])
    if step > cfg.train.steps:
        raise CheckpointError(f"{path} is at step {step} but train.steps = {cfg.train.steps}: "
                              f"nothing to train; train.steps counts from step 0, so pass "
                              f"--steps above {step}")
    return checked


def maybe_resume(trainer, found: tuple | None = None) -> None:
    """Resume as ``run.resume`` says. ``found``: what ``find_resume`` returned (looked up here
    when not given)."""
    found = found if found is not None else find_resume(trainer)
    if found is None:
        return
    path, checked = found
    trainer.step = load_into(trainer, path, checked)
    if trainer.grid.rank == 0:
        print(f"mpipar: resumed from {path} at step {trainer.step}", flush=True)
