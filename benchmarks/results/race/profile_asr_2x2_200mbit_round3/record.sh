#!/bin/bash
# How this profile was recorded: a 60-step race of ddp and adpsgd_hier_bf16 (2x2 at 200 Mbit/s),
# then py-spy on every rank of adpsgd_hier_bf16 for 40 s. Needs root and py-spy.
# Usage: bash record.sh [OUT_DIR]   (run from anywhere inside the repository)
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
OUT=${1:-/tmp/race-profile}
mkdir -p "$OUT"
rm -f "$OUT"/*.txt
.venv/bin/python benchmarks/race.py --workload asr --nodes 2 --procs 2 --rate 200 --epochs 0.25 \
  --max-steps 60 --target 0 --budget 200 --cases ddp adpsgd_hier_bf16 --keep-logs --timeout 900 \
  --prefix lgr --json "$OUT/race.json" --png "$OUT/race.png" > "$OUT/race.log" 2>&1 &
while ! grep -q "ddp done" "$OUT/race.log"; do sleep 1; done
sleep 8
i=0
for pid in $(pgrep -f race_worker.py); do
  if ! tr '\0' ' ' < "/proc/$pid/cmdline" | grep -q torch.distributed.run; then
    .venv/bin/py-spy record --pid "$pid" --rate 20 --nonblocking --threads --idle --format raw \
      --duration 40 --output "$OUT/adpsgd_hier_bf16_p$i.txt" > /dev/null 2>&1 &
    i=$((i+1))
  fi
done
wait
echo "profiled $i ranks"
