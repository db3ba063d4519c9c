"""Hand-made timing dumps for tests and demos, written with h5py straight from docs/dump_schema.md.

Deliberately independent of ``mpipar.trace`` (the real writer): if both follow the schema, the
analysis reads both, and a test that reads a dump from each catches a drift in either.
"""

from __future__ import annotations

import json

import numpy as np

# the on-disk dtype of /ranks/<r>/events (schema version 1)
DISK_EVENT_DTYPE = np.dtype(
    [
        ("kind", "S24"),
        ("step", "i4"),
        ("mb", "i4"),
        ("chunk", "i4"),
        ("start", "f8"),
        ("end", "f8"),
        ("bytes", "i8"),
        ("peer", "i4"),
    ]
)

DISK_METRICS_DTYPE = np.dtype(
    [
        ("step", "i4"),
        ("loss", "f8"),
        ("val_loss", "f8"),
        ("lr", "f8"),
        ("grad_norm", "f8"),
        ("tokens", "i8"),
        ("step_time", "f8"),
    ]
)


def ev(kind, step, start, end, mb=-1, chunk=-1, nbytes=0, peer=-1) -> tuple:
    """One event row, in schema field order."""
    return (kind, step, mb, chunk, start, end, nbytes, peer)


def gpt_config(**over) -> dict:
    """A small GPT run config with the fields analysis reads."""
    cfg = {
        "model": {
            "kind": "gpt",
            "n_layer": 4,
            "n_embd": 64,
            "n_head": 4,
            "vocab_size": 256,
            "seq_len": 32,
        },
        "batch_size": 8,
        "microbatches": 4,
        "schedule": "1f1b",
        "virtual_stages": 1,
        "dtype": "float32",
        "device": "cpu",
    }
    cfg.update(over)
    return cfg


def write(
    path,
    events,
    grid,
    config=None,
    coords=None,
    metrics=None,
    attrs=None,
    drop_attrs=(),
    drop_fields=(),
    schema_version=1,
) -> str:
    """Write a schema-v1 dump.

    ``events[r]``: list of ``ev(...)`` tuples of world rank r. ``grid``: {"dp","pp","tp"}.
    ``coords[r]``: (dp, pp, tp) of rank r; by default world ranks are ordered tp fastest, then pp,
    then dp (the schema's "tp-pp-dp" order). ``drop_attrs`` / ``drop_fields`` leave out file
    attributes / event fields, to test the reader's errors.
    """
    import h5py

    world = len(events)
    grid = {"order": "tp-pp-dp", **grid}
    if coords is None:
        tp, pp = grid["tp"], grid["pp"]
        coords = [((r // (tp * pp)), (r // tp) % pp, r % tp) for r in range(world)]
    file_attrs = {
        "schema_version": schema_version,
        "config": json.dumps(config if config is not None else gpt_config()),
        "grid": json.dumps(grid),
        "world_size": world,
        "hostnames": json.dumps(["localhost"] * world),
        "devices": json.dumps(["cpu"] * world),
        "versions": json.dumps({"python": "3", "numpy": np.__version__}),
        "git_commit": "unknown",
        "start_time": "2024-01-01T00:00:00+00:00",
        "complete": True,
    }
    file_attrs.update(attrs or {})
    dtype = DISK_EVENT_DTYPE
    if drop_fields:
        dtype = np.dtype(
            [(n, DISK_EVENT_DTYPE[n]) for n in DISK_EVENT_DTYPE.names if n not in drop_fields]
        )
    with h5py.File(path, "w") as f:
        for key, value in file_attrs.items():
            if key not in drop_attrs:
                f.attrs[key] = value
        ranks = f.create_group("ranks")
        for r, rows in enumerate(events):
            full = np.array([tuple(row) for row in rows], dtype=DISK_EVENT_DTYPE)
            data = np.empty(len(full), dtype=dtype)
            for name in dtype.names:
                data[name] = full[name]
            g = ranks.create_group(str(r))
            g.create_dataset("events", data=data)
            dp, pp, tp = coords[r]
            g.attrs.update({"dp": dp, "pp": pp, "tp": tp, "hostname": "localhost", "device": "cpu"})
        if metrics is not None:
            f.create_dataset("metrics", data=np.array(metrics, dtype=DISK_METRICS_DTYPE))
    return str(path)


def pipeline_events(
    pp=2,
    microbatches=4,
    steps=2,
    f=1.0,
    b=2.0,
    opt=0.5,
    comm=0.1,
    step_gap=1.0,
    tp=1,
    dp=1,
    loss=0.05,
):
    """Events of a GPipe-like run (one chunk per stage), ``events[r]`` per world rank.

    GPipe order: all forwards, then all backwards, then the optimizer; receives take ``comm``
    before a forward of a later stage, sends are short posts after it. The layout is plausible
    and deterministic, covering every action kind; used for plots and the CLI. The exact-answer
    tests build their events by hand.
    """
    world = dp * pp * tp
    events = [[] for _ in range(world)]
    t = 0.0
    for step in range(steps):
        # per stage timeline of F (forward wave) then B (backward wave), GPipe order
        f_end = {}
        b_end = {}
        for s in range(pp):
            for m in range(microbatches):
                prev = f_end.get((s - 1, m), t) + (comm if s > 0 else 0.0)
                start = max(prev, f_end.get((s, m - 1), t))
                f_end[(s, m)] = start + f
        for s in reversed(range(pp)):
            for m in range(microbatches):
                dep = b_end.get((s + 1, m), f_end[(pp - 1, microbatches - 1)]) + (
                    comm if s < pp - 1 else 0
                )
                start = max(dep, b_end.get((s, m - 1), f_end[(s, microbatches - 1)]))
                b_end[(s, m)] = start + b
        opt_start = max(b_end.values())
        step_end = opt_start + opt
        for r in range(world):
            s = (r // tp) % pp  # pipeline stage of world rank r
            rows = events[r]
            rows.append(ev("STEP", step, t, step_end))
            for m in range(microbatches):
                fe = f_end[(s, m)]
                if s > 0:
                    rows.append(
                        ev(
                            "pp.recv",
                            step,
                            fe - f - comm,
                            fe - f,
                            mb=m,
                            chunk=0,
                            nbytes=4096,
                            peer=r - tp,
                        )
                    )
                if s == pp - 1:  # the loss runs in the tail of the last stage's forward slot
                    rows.append(ev("F", step, fe - f, fe - loss, mb=m, chunk=0))
                    rows.append(ev("LOSS", step, fe - loss, fe, mb=m, chunk=0))
                else:
                    rows.append(ev("F", step, fe - f, fe, mb=m, chunk=0))
                if tp > 1:
                    rows.append(
                        ev("tp.allreduce", step, fe - f / 4, fe - f / 8, mb=m, chunk=0, nbytes=1024)
                    )
                if s < pp - 1:
                    rows.append(
                        ev(
                            "pp.send",
                            step,
                            fe,
                            fe + comm / 10,
                            mb=m,
                            chunk=0,
                            nbytes=4096,
                            peer=r + tp,
                        )
                    )
            for m in range(microbatches):
                be = b_end[(s, m)]
                rows.append(ev("B", step, be - b, be, mb=m, chunk=0))
            if dp > 1:
                rows.append(
                    ev("dp.allreduce", step, opt_start, opt_start + opt / 2, nbytes=1 << 20)
                )
            rows.append(
                ev("world.allreduce", step, opt_start + opt / 2, opt_start + opt * 0.6, nbytes=8)
            )
            rows.append(ev("OPT", step, opt_start + opt * 0.6, step_end))
        t = step_end + step_gap
    return events
