#!/usr/bin/env bash
# The race campaign of docs/races.md ("Race rules"): three races under the rules (about 5
# hours idle on 2 cores; the 1 Gbit/s race, about 1 hour, and the remedies' race, about 2 hours,
# only when asked for), then the docs regenerated from their records. Needs root and an idle
# 2-core machine; link latency is `netem`'s, or testbed/link_delay.py's (iptables, installed here
# if missing). Every race appends its record after each case: started again, this script goes
# on where it stopped (finished races launch nothing).
#
#   sudo bash benchmarks/race/run_campaign.sh            # main, slow, sites; then the docs
#   sudo RACES="remedies gbit slowremedies" bash benchmarks/race/run_campaign.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
OUT=benchmarks/results/race/fair
RACES=${RACES:-"main slow sites"}
# The workload (ASR, 2x2 ranks, the BLSTM 2x256): a fixed target of 20 % dev WER (ddp at 3e-3
# first reached it at 3680 samples: benchmarks/results/race/sizing/), validation every 160
# samples (0.043 of that), AdamW at the tuned peak, at most 8000 samples per case.
COMMON=(--workload asr --nodes 2 --procs 2 --target 20 --eval-every 160 --max-samples 8000
        --runs 3)
PEERS=(ddp ddp_bf16 postlocal16 torchft_localsgd torchft_diloco)
LIBRARY=(dpsgd_hier_bf16 adpsgd_hier_bf16)
# the remedies' race: their cases next to their baselines (the overlapped node all-reduce; the
# outer optimizer on a 16-step global average and its plain-average control)
REMEDIES=(ddp postlocal16 dpsgd_hier_bf16 dpsgd_hier_bf16_overlap adpsgd_hier_bf16
          adpsgd_hier_bf16_overlap adpsgd_hier_bf16_avg16 adpsgd_hier_bf16_outer16)
# the two-site and 1 Gbit/s races: ddp, its bf16 hook, post-local SGD, the library's two cases;
# the slow-node race without post-local SGD (every synchronous peer waits for the slow node
# alike; ddp_bf16 stands for them)
FEW=(ddp ddp_bf16 postlocal16 dpsgd_hier_bf16 adpsgd_hier_bf16)
SLOW=(ddp ddp_bf16 dpsgd_hier_bf16 adpsgd_hier_bf16)
# the remedies under the slow node: the overlapped node all-reduce and the balanced epoch end
SLOW_REMEDIES=(ddp ddp_bf16 adpsgd_hier_bf16 adpsgd_hier_bf16_overlap adpsgd_hier_bf16_balanced)
MAIN=$OUT/asr_2x2_200mbit_0.5ms.json
command -v iptables >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
  apt-get install -y -qq iptables >/dev/null)

race() {  # name, then the race's own arguments
  local name=$1; shift
  echo "== race $name: $*" >&2
  "$PY" -m benchmarks.race.campaign "${COMMON[@]}" "$@"
}

for r in $RACES; do
  case $r in
    main) race main --rate 200 --latency-ms 0.5 --cases "${PEERS[@]}" "${LIBRARY[@]}" \
            --out "$MAIN" ;;
    slow) race slow --rate 200 --latency-ms 0.5 --slow-node 1 --cases "${SLOW[@]}" \
            --tuning-from "$MAIN" --out $OUT/asr_2x2_200mbit_0.5ms_slow1.json ;;
    gbit) race gbit --rate 1000 --latency-ms 0.5 --cases "${FEW[@]}" \
            --tuning-from "$MAIN" --out $OUT/asr_2x2_1000mbit_0.5ms.json ;;
    sites) race sites --rate 100 --latency-ms 25 --cases "${FEW[@]}" \
             --tuning-from "$MAIN" --out $OUT/asr_2x2_100mbit_25ms.json ;;
    remedies) race remedies --rate 200 --latency-ms 0.5 --cases "${REMEDIES[@]}" \
                --tuning-from "$MAIN" --out $OUT/asr_2x2_200mbit_0.5ms_remedies.json ;;
    slowremedies) race slowremedies --rate 200 --latency-ms 0.5 --slow-node 1 \
                    --slow-extra-s 0.3568978640032583 --cases "${SLOW_REMEDIES[@]}" \
                    --tuning-from "$MAIN" $OUT/asr_2x2_200mbit_0.5ms_remedies.json \
                    --out $OUT/asr_2x2_200mbit_0.5ms_slow1_remedies.json ;;
    *) echo "unknown race $r (main slow sites gbit remedies slowremedies)" >&2; exit 2 ;;
  esac
done
"$PY" -m benchmarks.race.docs
