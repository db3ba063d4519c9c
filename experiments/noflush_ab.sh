#!/usr/bin/env bash
# Flush against no flush at pp = 2: 1F1B, continuous PipeDream and continuous PipeDream-2BW, all
# with --layout auto, m = 4 and 8, the tiny GPT and the MLP configs, in interleaved A/B rounds
# (each round runs every schedule once, in turn, so drift in machine load hits all alike).
# Then one `mpipar analyze` table over every run, and noflush_summary.py: per run the bubble
# measured and as its calibrated prediction simulates it, the step time measured and predicted,
# tokens/s, and each continuous run against the 1F1B run of its round, configuration and m.
# The timing dump is written once, at the end (run.flush_interval = 0): a flush of the dump in
# the middle of a run (every 50 steps by default) takes 20-40 ms of file I/O on this machine,
# a third of the measured window of the MLP's 60 steps of about a millisecond, and lands in
# one run of a pair and not the other's window by chance.
#
# Run alone on the machine: bash experiments/noflush_ab.sh [OUT] [ROUNDS] [STEPS]
# (defaults /tmp/noflush_ab, 3 rounds, 60 steps for the tiny GPT and 600 for the MLP (MLP_STEPS):
# 36 runs, about 45 s a round on 2 idle cores, then about two minutes of analysis).
# MS and SCHEDS (environment) change the sweep, STEADY_S the steadiness sample's seconds; the
# figure of bubble against m (noflush_figure.py) takes one round of every schedule at
# m = 2, 4, 8, 16:
#   MS="2 4 8 16" SCHEDS="gpipe 1f1b pipedream-cont pipedream-2bw-cont" ANALYZE=0 \
#     bash experiments/noflush_ab.sh /tmp/noflush_fig 1 30
set -euo pipefail
OUT=${1:-/tmp/noflush_ab}
ROUNDS=${2:-3}
STEPS=${3:-60}
MS=${MS:-4 8}
SCHEDS=${SCHEDS:-1f1b pipedream-cont pipedream-2bw-cont}
HERE=$(cd "$(dirname "$0")" && pwd)
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 PYTHONPATH=${PYTHONPATH:-$HERE/..}
mkdir -p "$OUT"
DATA=$OUT/pattern.h5
[ -f "$DATA" ] || python -c "from mpipar.datasets import prepare_synthetic; \
prepare_synthetic('$DATA', 'pattern', 200000, 256, seed=1)"
echo "load before: $(cut -d' ' -f1-3 /proc/loadavg)"
# how steady the machine's speed is, before and after (mpipar/plan/steadiness.py): what one
# pair of runs can resolve here (STEADY_S=0 leaves it out)
steady() { [ "${STEADY_S:-10}" = 0 ] || python -m mpipar.cli bench --steadiness --seconds "${STEADY_S:-10}"; }
steady
for round in $(seq 1 "$ROUNDS"); do
  for cfg in tiny mlp; do
    data=(); [ "$cfg" = tiny ] && data=(--data "$DATA")
    # the MLP's steps take about a millisecond: ten times the steps, so that a run's measured
    # window (about 0.6 s) is not one scheduler hiccup away from another verdict
    steps=$STEPS; [ "$cfg" = mlp ] && steps=${MLP_STEPS:-$((STEPS * 10))}
    for m in $MS; do
      for sched in $SCHEDS; do
        kind=${sched%-cont}; cont=false; [ "$kind" != "$sched" ] && cont=true
        run=$OUT/r${round}_${cfg}_m${m}_${sched}
        rm -rf "$run"
        mpiexec -n 2 python -m mpipar.cli train --config "$HERE/configs/$cfg.toml" \
          "${data[@]}" --out "$run" --pp 2 --microbatches "$m" --schedule "$kind" \
          --set "parallel.continuous=$cont" --layout auto --steps "$steps" --quiet \
          --set train.eval_interval=0 --set run.flush_interval=0 >/dev/null
      done
    done
  done
done
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)"
steady
# ANALYZE=0 leaves out the `mpipar analyze` table (the figure's sweep needs the summary only)
[ "${ANALYZE:-1}" = 0 ] || python -m mpipar.cli analyze "$OUT" | sed -n '/^comparison:/,$p'
python "$HERE/noflush_summary.py" "$OUT"
