#!/usr/bin/env bash
# Regenerates every figure and table of docs/analysis.md from the lightning-gossip CLI.
#
#   bash benchmarks/analysis/make_figures.sh            # all (about 10-15 minutes on 2 cores)
#   bash benchmarks/analysis/make_figures.sh gaps        # only one part: gaps | training | async
#
# Outputs: docs/figures/*.png, and the printed tables + raw curves (JSON) under
# benchmarks/analysis/results/. Everything is seeded; reruns give the same numbers.
set -euo pipefail
cd "$(dirname "$0")/../.."
LG=${LG:-.venv/bin/lightning-gossip}
RES=benchmarks/analysis/results
FIG=docs/figures
mkdir -p "$RES" "$FIG"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
what=${1:-all}

if [[ $what == all || $what == gaps ]]; then
  # Figure 1: spectral gap and consensus steps vs world size, every topology.
  $LG topologies --world-sizes 8 16 32 64 128 256 512 1024 --max-steps 100000 \
    --model-params 25.6M --plot "$FIG/spectral_gap.png" --json "$RES/topologies.json" \
    | tee "$RES/topologies.txt"
fi

if [[ $what == all || $what == training ]]; then
  # Figure 2: D-PSGD on the digits MLP, ring vs random_ring vs complete (= all-reduce SGD:
  # with --no-overlap, x <- W (x - lr g) with W = J/n is exactly synchronous all-reduce SGD).
  for part in iid sorted; do
    $LG simulate --world-sizes 16 64 128 --topologies ring random_ring complete \
      --steps 400 --lr 0.5 --batch-size 16 --no-overlap --partition $part --eval-every 5 \
      --target-loss 0.2 --seed 0 --plot "$FIG/training_$part.png" --json "$RES/training_$part.json" \
      | tee "$RES/training_$part.txt"
  done
  # The same runs in the strategy's default overlapped form (table only).
  $LG simulate --world-sizes 16 64 128 --topologies ring random_ring complete \
    --steps 400 --lr 0.5 --batch-size 16 --partition iid --eval-every 5 \
    --target-loss 0.2 --seed 0 --no-progress | tee "$RES/training_iid_overlap.txt"
fi

if [[ $what == all || $what == async ]]; then
  # Figure 3: AD-PSGD vs synchronous D-PSGD / all-reduce with 1 learner of 64 four times slower.
  $LG simulate --world-sizes 64 --algorithms dpsgd adpsgd --topologies random_ring complete \
    --pairings random ring --slow 1 --slow-factor 4 --steps 400 --lr 0.5 --no-overlap \
    --eval-every 5 --target-loss 0.2 --seed 0 --plot "$FIG/async_slow_learner.png" \
    --json "$RES/async_slow_learner.json" | tee "$RES/async_slow_learner.txt"
  # Reference: the same without the slow learner (table only).
  $LG simulate --world-sizes 64 --algorithms dpsgd adpsgd --topologies random_ring complete \
    --pairings random ring --steps 400 --lr 0.5 --no-overlap --eval-every 5 \
    --target-loss 0.2 --seed 0 --no-progress | tee "$RES/async_no_slow_learner.txt"
  # What the one-step exchange delay costs AD-PSGD (table only): an exchange in flight for
  # 0 steps (atomic, --adpsgd-no-overlap) or 1 (overlapped with the next step, the default).
  for d in 0 1; do
    overlap=(); [[ $d == 0 ]] && overlap=(--adpsgd-no-overlap)
    $LG simulate --world-sizes 64 --algorithms adpsgd --pairings random --steps 200 --lr 0.5 \
      --eval-every 5 --target-loss 0.2 --seed 0 "${overlap[@]}" --no-progress \
      | tee "$RES/async_delay$d.txt"
  done
fi
