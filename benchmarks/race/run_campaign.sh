#!/usr/bin/env bash
# The race campaign of docs/benchmarks.md ("Race rules"): five races under the rules, then the
# docs regenerated from their records. Needs root, an idle 2-core machine and a kernel with
# `netem` (each race refuses otherwise and says why). Every race appends its record after each
# case: started again, this script goes on where it stopped (finished races launch nothing).
#
#   sudo bash benchmarks/race/run_campaign.sh            # all five races, then the docs
#   sudo RACES="main slow" bash benchmarks/race/run_campaign.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
OUT=benchmarks/results/race/fair
RACES=${RACES:-"main slow gbit sites remedies"}
# The workload (ASR, 2x2 ranks): a fixed target of 20 % dev WER, validation every 160 samples,
# the learning rate halved per pass after 2 passes (at a constant rate ddp stays at 32-34 %
# dev WER from 4000 to 7200 samples), at most 9600 samples (6 passes) per case.
COMMON=(--workload asr --nodes 2 --procs 2 --target 20 --eval-every 160 --max-samples 9600
        --anneal-after 2 --anneal-per-pass 0.5 --runs 3)
PEERS=(ddp ddp_bf16 postlocal16 torchft_localsgd torchft_diloco)
LIBRARY=(dpsgd_hier_bf16 adpsgd_hier_bf16)
# the secondary races: ddp, the bf16 hook, the two periodic averagers and the library's cases
FEW=(ddp ddp_bf16 postlocal16 torchft_localsgd dpsgd_hier_bf16 adpsgd_hier_bf16)
MAIN=$OUT/asr_2x2_200mbit_0.5ms.json

race() {  # name, then the race's own arguments
  local name=$1; shift
  echo "== race $name: $*" >&2
  "$PY" -m benchmarks.race.campaign "${COMMON[@]}" "$@"
}

for r in $RACES; do
  case $r in
    main) race main --rate 200 --latency-ms 0.5 --cases "${PEERS[@]}" "${LIBRARY[@]}" \
            --out "$MAIN" ;;
    slow) race slow --rate 200 --latency-ms 0.5 --slow-node 1 --cases "${FEW[@]}" \
            --tuning-from "$MAIN" --out $OUT/asr_2x2_200mbit_0.5ms_slow1.json ;;
    gbit) race gbit --rate 1000 --latency-ms 0.5 --cases "${FEW[@]}" \
            --tuning-from "$MAIN" --out $OUT/asr_2x2_1000mbit_0.5ms.json ;;
    sites) race sites --rate 100 --latency-ms 25 --cases "${FEW[@]}" \
             --tuning-from "$MAIN" --out $OUT/asr_2x2_100mbit_25ms.json ;;
    remedies) race remedies --rate 200 --latency-ms 0.5 --cases ddp postlocal16 \
                dpsgd_hier_bf16 dpsgd_hier_bf16_overlap adpsgd_hier_bf16 \
                adpsgd_hier_bf16_overlap adpsgd_hier_bf16_avg16 adpsgd_hier_bf16_outer16 \
                --tuning-from "$MAIN" --out $OUT/asr_2x2_200mbit_0.5ms_remedies.json ;;
    *) echo "unknown race $r (main slow gbit sites remedies)" >&2; exit 2 ;;
  esac
done
"$PY" -m benchmarks.race.docs
