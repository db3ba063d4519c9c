"""``analysis.memory_model``: an interleaved rank's live pairs weighed by their own chunk."""

from __future__ import annotations

from mpipar.analysis.memory_model import _units, chunk_bounds, predict_run, rank_memory
from mpipar.parallel.pipeline.generators import build_schedule
from mpipar.parallel.pipeline.simulate import simulate


def _tiny(schedule, v):
    return {"model": {"kind": "gpt", "vocab_size": 256, "block_size": 64, "n_layer": 4,
                      "n_embd": 64, "n_head": 4},
            "train": {"batch_size": 16, "seq_len": 64, "dtype": "float32"},
            "parallel": {"schedule": schedule, "microbatches": 4, "virtual_stages": v,
                         "partition": "uniform"}}


def test_interleaved_rank_peaks_on_its_larger_chunks_pairs():
    """Tiny GPT, pp = 2, v = 2: rank 1 holds chunk 1 (two blocks) and chunk 3 (the head); its
    order (F0.1 F1.1 F0.3 BW0.3 F1.3 BW1.3 F2.1 ...) peaks with three pairs of chunk 1 live,
    not three of the two chunks' mean; rank 0's peak of five pairs has its own mix."""
    cfg, grid = _tiny("interleaved", 2), {"dp": 1, "pp": 2, "tp": 1}
    units, _ = _units(cfg, grid)
    bounds = chunk_bounds(cfg, grid, 2)
    stored = {c: sum(units[i][1] for i in range(*bounds[c])) for c in bounds}
    rows = predict_run(cfg, grid)
    sched = build_schedule("interleaved", 2, 4, virtual_stages=2)
    live = simulate(sched).peak_activations
    assert live == [5, 3]
    # BW actions: only the chunk's last unit's gradients sit on the stored contexts
    retained = max(units[3][2], units[5][2])
    assert bounds[1] == (2, 4) and bounds[3] == (5, 6)
    assert rows[1]["activations"] == int(4 * (3 * stored[1] + retained))
    assert 3 * stored[1] > 3 * (stored[1] + stored[3]) / 2  # what the mean gave: less
    assert rank_memory(cfg, grid, sched, live, bounds) == rows  # predict_run's own call


def test_one_chunk_per_rank_is_live_times_its_chunk():
    """1F1B (one chunk a rank): the walk gives live x the chunk's values, as before."""
    cfg, grid = _tiny("1f1b", 1), {"dp": 1, "pp": 2, "tp": 1}
    units, _ = _units(cfg, grid)
    bounds = chunk_bounds(cfg, grid, 1)
    live = simulate(build_schedule("1f1b", 2, 4)).peak_activations
    for p, row in enumerate(predict_run(cfg, grid)):
        span = range(*bounds[p])
        want = live[p] * sum(units[i][1] for i in span) + units[span[-1]][2]  # BW actions
        assert row["activations"] == int(4 * want)
