"""Experiment 6: tensor-parallel modes side by side on the same GPT.

4 ranks: 1d (Megatron) vs 2d (Optimus, q = 2); 8 ranks: 1d vs 2.5d (Tesseract, q = 2, d = 2)
vs 3d (q = 2);
plus the one-rank model as the memory reference. Per rank and step: ``MiB_step`` (bytes handed to
tp collectives, measured by the tracer) beside ``pred_MiB`` (the formula below), parameter and
activation memory per rank and their ratio to one rank's (``param_ratio``, ``act_ratio``;
``ideal`` = 1/tp for activations: 1d reaches it for the weight matrices only; 2d, 2.5d and 3d
for every activation; ``ideal_param`` = 1/q^2 for 2.5d, whose weight blocks are replicated
over depth by design; LayerNorm, bias and position vectors are cut by one grid dim only in every
mode), and the median step time.

Formulas (payload bytes per rank per step, item = bytes per element, m micro-batches of b_m
sequences of s tokens, hidden h, L blocks, vocabulary V):
- 1d: m [(4L + 2) b_m s h + 3 b_m s] item (Megatron: two all-reduces forward and two backward
  per block, embedding and head one each, the loss three scalars per token);
- 2d: per SUMMA linear (d_in -> d_out) and micro-batch, with X = (b_m/q) s d_in/q and
  W = d_in d_out / q^2 elements: 2q X + 2q W broadcasts + q X + q W reduced (Optimus), a bias
  d_out/q; per LayerNorm 4 (b_m/q) s + 2h/q; the embedding b_m s h/q + (b_m/q) s h/q, positions
  s h/q; the loss 3 (b_m/q) s, plus one float64 (8 bytes) per micro-batch;
- 2.5d (Tesseract, d layers of 2d, each on b_m/d sequences: T = b_m s / (d q)): 2d's terms
  plus, per micro-batch, an all-reduce over depth of every weight block W, every vector block
  (biases, LayerNorm, positions) and the embedding table block (V/q x h/q), and one scalar;
- 3d (T = b_m s / q^2 per rank): per linear (2 + q)(X + W) + (q + 1) Y + a bias d_out/q, with
  X = T d_in/q, W = d_in d_out / q^3, Y = T d_out/q (all-gathers of the input piece twice and of
  the weight piece twice, reduce-scatters of q-fold outputs, input and weight gradients, the
  all-gather of the output gradient); per LayerNorm 4T + 4h/q; the embedding b_m s h/q +
  2 q T h/q + T h/q, positions 2 s h/q; the loss 3T plus two scalars per micro-batch;
- the gradient norm's partial sum is not counted: it goes with the loss in one world all-reduce.

Ranks outnumber the cores of a small machine: step times are oversubscribed and indicative
only; bytes and memory are exact. Run: ``python experiments/tp_modes.py [--quick] [--out DIR]``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

NAME = "tp_modes"
COLUMNS = ["ranks", "mode", "MiB_step", "pred_MiB", "param_MiB", "param_ratio", "act_MiB",
           "act_ratio", "ideal", "ideal_param", "step_ms"]
MiB = 2.0**20
MODEL = {"model.n_layer": 4, "model.n_embd": 128, "model.n_head": 8, "model.block_size": 64,
         "model.vocab_size": 256, "train.batch_size": 16, "train.seq_len": 64,
         "parallel.microbatches": 2, "train.dtype": "float32"}
QUICK = {"model.n_layer": 2, "model.n_embd": 32, "model.n_head": 8, "model.block_size": 8,
         "model.vocab_size": 256, "train.batch_size": 8, "train.seq_len": 8,
         "parallel.microbatches": 2, "train.dtype": "float32"}
RUNS = [(1, "1d"), (4, "1d"), (4, "2d"), (8, "1d"), (8, "2.5d"), (8, "3d")]
DEPTH = 2


def _elems_2d(m: dict, q: int, d: int) -> tuple[int, int]:
    """(elements, float64 scalars) handed to collectives per micro-batch: 2D (d = 1), 2.5D."""
    L, h, V, s = m["model.n_layer"], m["model.n_embd"], m["model.vocab_size"], m["train.seq_len"]
    b = m["train.batch_size"] // m["parallel.microbatches"]
    T = b // (d * q) * s
    dep = 1 if d > 1 else 0  # 2.5D: every gradient also summed over depth

    def lin(din, dout, bias=True):
        x, w = T * din // q, din * dout // q // q
        return 3 * q * (x + w) + dep * w + (1 + dep) * (dout // q if bias else 0)

    ln = 4 * T + (1 + dep) * 2 * h // q
    block = 2 * ln + lin(h, 3 * h) + lin(h, h) + lin(h, 4 * h) + lin(4 * h, h)
    emb = b // d * s * h // q + T * h // q + dep * V * h // q // q + (1 + dep) * s * h // q
    return emb + L * block + ln + lin(h, V, False) + 3 * T, 1 + dep


def _elems_3d(m: dict, q: int) -> tuple[int, int]:
    L, h, V, s = m["model.n_layer"], m["model.n_embd"], m["model.vocab_size"], m["train.seq_len"]
    b = m["train.batch_size"] // m["parallel.microbatches"]
    T = b // (q * q) * s

    def lin(din, dout, bias=True):
        x, w, y = T * din // q, din * dout // q // q // q, T * dout // q
        return (2 + q) * (x + w) + (q + 1) * y + (dout // q if bias else 0)

    ln = 4 * T + 4 * h // q
    block = 2 * ln + lin(h, 3 * h) + lin(h, h) + lin(h, 4 * h) + lin(4 * h, h)
    emb = b * s * h // q + 2 * q * T * h // q + T * h // q + 2 * s * h // q
    return emb + L * block + ln + lin(h, V, False) + 3 * T, 2


def predicted(m: dict, tp: int, mode: str) -> float:
    """Bytes per rank per step handed to tp collectives (the formulas of the docstring)."""
    item = 8 if m["train.dtype"] == "float64" else 4
    mb = m["parallel.microbatches"]
    b, s, h, L = (m["train.batch_size"] // mb, m["train.seq_len"], m["model.n_embd"],
                  m["model.n_layer"])
    if tp == 1:
        return 0.0
    if mode == "1d":
        return mb * ((4 * L + 2) * b * s * h + 3 * b * s) * item
    if mode == "3d":
        elems, scalars = _elems_3d(m, round(tp ** (1 / 3)))
    else:
        d = DEPTH if mode == "2.5d" else 1
        elems, scalars = _elems_2d(m, round((tp // d) ** 0.5), d)
    return mb * (elems * item + 8 * scalars)


def main(argv=None) -> int:
    args = common.parser(NAME, __doc__).parse_args(argv)
    out = common.out_dir(args, NAME)
    m = QUICK if args.quick else MODEL
    steps = args.steps or (2 if args.quick else 4)
    driver = Path(__file__).resolve().parent / "tp_modes_driver.py"
    rows, one = [], None
    for ranks, mode in RUNS:
        cmd = ["mpiexec", "-n", str(ranks), sys.executable, str(driver), "--tp", str(ranks),
               "--mode", mode, "--steps", str(steps)]
        for k, v in {**m, "parallel.tp_depth": DEPTH if mode == "2.5d" else 1}.items():
            cmd += ["--set", f"{k}={v}"]
        text = common.run_command(cmd, args.timeout, f"{mode} tp={ranks}")
        r = json.loads(next(ln for ln in text.splitlines() if ln.startswith("RESULT "))[7:])
        one = one or r  # the first run is the one-rank model
        rows.append({"ranks": ranks, "mode": mode, "MiB_step": r["bytes"] / MiB,
                     "pred_MiB": predicted(m, ranks, mode) / MiB,
                     "param_MiB": r["params"] / MiB, "param_ratio": r["params"] / one["params"],
                     "act_MiB": r["act"] / MiB, "act_ratio": r["act"] / one["act"],
                     "ideal": 1.0 / ranks,
                     "ideal_param": 1.0 / (ranks // DEPTH if mode == "2.5d" else ranks),
                     "step_ms": 1e3 * r["step_s"]})
    common.write_results(out, NAME, rows, COLUMNS,
                         meta={"model": m, "steps": steps, **common.machine_note()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
