#!/usr/bin/env bash
# The race campaign of benchmarks/race/CAMPAIGN.md (issue 47: races by regime of R, every peer
# at its best, a seed per run, the 12 % WER target): the tuning, then the races by regime,
# then the docs regenerated from their records. Needs root and an idle 2-core machine; link
# latency is `netem`'s, or testbed/link_delay.py's (iptables, installed here if missing). Every
# race appends its record after each case: started again, this script goes on where it stopped
# (finished races launch nothing). The records go to benchmarks/results/race/regimes/.
#
#   sudo RACES=tune bash benchmarks/race/run_campaign.sh   # the tuning (2.25 h measured; done)
#   sudo RACES=mid bash benchmarks/race/run_campaign.sh    # one race per sitting (2.5-3 h each:
#                                                          # mid, high, low; slow, sites ~1.5/1.2 h)
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
OUT=benchmarks/results/race/regimes
RACES=${RACES:-"tune mid high low"}
# The workload (ASR, 2x2 ranks, the BLSTM 2x256): a fixed target of 12 % dev WER (ddp at 3e-3
# first reached 11.5 % at 4800 samples: benchmarks/results/race/sizing/), validation every 160
# samples (0.033 of that), AdamW at the tuned peak, at most 9600 samples per case (2x ddp's),
# 3 runs per case, run k from seed 1 + k in every case.
COMMON=(--workload asr --nodes 2 --procs 2 --target 12 --eval-every 160 --max-samples 9600
        --runs 3)
TUNE=$OUT/asr_2x2_tuning_1000mbit_0.5ms.json
# The tuning: each family's base case at its three peaks (variants take their base's peak), on
# the 1 Gbit/s link (R about 0.1: the fastest trials; the pick is by samples to the target,
# which the link does not change for the synchronous methods), a trial stopped at 8000 samples
# or at the samples its case's best trial so far needed.
BASES=(ddp ddp_bf16 ddp_powersgd4 postlocal16 torchft_localsgd torchft_diloco16_o7m9 decentdp
       dpsgd_hier_bf16 adpsgd_hier_bf16)
# The races: every variant in run 0, each family's fastest variant in runs 1 and 2
# (--narrow-after 1). fp32 ddp only where R < 1 (elsewhere its step is several times every
# other case's; its samples to the target, for the validation-interval rule, come from the
# tuning record: --ddp-reference). gossip_every_n_steps cases (the _p4/_p16 names) need the
# budget work in the library; without it the race skips them with a message.
LOW=(ddp ddp_b1 ddp_bf16 postlocal16 torchft_localsgd torchft_diloco16_o7m9
     torchft_diloco16_o10m0 decentdp dpsgd_hier_bf16 adpsgd_hier_bf16)
# The "auto" cases (gossip_every_n_steps="auto", the _pauto names) race every run next to
# their family's fastest fixed period (a family of their own for --narrow-after): the goal is
# "auto" within 10 % of the best fixed period in each regime.
MID=(ddp_bf16 ddp_powersgd4 postlocal16 postlocal64 torchft_localsgd dpsgd_hier_bf16_p4
     dpsgd_hier_bf16_p16 adpsgd_hier_bf16 adpsgd_hier_bf16_p4 dpsgd_hier_bf16_pauto
     adpsgd_hier_bf16_pauto)
HIGH=(ddp_powersgd4 postlocal16 postlocal64 torchft_localsgd64 dpsgd_hier_bf16_p16
      adpsgd_hier_bf16_p16 dpsgd_hier_bf16_pauto adpsgd_hier_bf16_pauto)
# the slow node (node 1, about 2x slower, pinned: each node on a CPU of its own): the peers
# that beat ddp's bf16 hook in the schema-2 races, Decent-DP, the library's two cases
SLOW=(ddp_bf16 postlocal16 torchft_localsgd decentdp dpsgd_hier_bf16 adpsgd_hier_bf16)
SITES=(ddp_bf16 postlocal16 torchft_localsgd dpsgd_hier_bf16 adpsgd_hier_bf16)
command -v iptables >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
  apt-get install -y -qq iptables >/dev/null)

race() {  # name, then the race's own arguments
  local name=$1; shift
  echo "== race $name: $*" >&2
  "$PY" -m benchmarks.race.campaign "${COMMON[@]}" "$@"
}

for r in $RACES; do
  case $r in
    tune) race tune --rate 1000 --latency-ms 0.5 --runs 0 --tuning-max-samples 8000 \
            --cases "${BASES[@]}" --out "$TUNE" ;;
    low) race low --rate 200 --latency-ms 0.5 --narrow-after 1 --cases "${LOW[@]}" \
           --tuning-from "$TUNE" --out $OUT/asr_2x2_200mbit_0.5ms.json ;;
    mid) race mid --rate 30 --latency-ms 0.5 --narrow-after 1 --cases "${MID[@]}" \
           --tuning-from "$TUNE" --ddp-reference "$TUNE" --out $OUT/asr_2x2_30mbit_0.5ms.json ;;
    high) race high --rate 8 --latency-ms 0.5 --narrow-after 1 --cases "${HIGH[@]}" \
            --tuning-from "$TUNE" --ddp-reference "$TUNE" \
            --out $OUT/asr_2x2_8mbit_0.5ms.json ;;
    slow) race slow --rate 200 --latency-ms 0.5 --slow-node 1 --pin-nodes --cases "${SLOW[@]}" \
            --tuning-from "$TUNE" --ddp-reference "$TUNE" \
            --out $OUT/asr_2x2_200mbit_0.5ms_slow1_pinned.json ;;
    sites) race sites --rate 100 --latency-ms 25 --cases "${SITES[@]}" \
             --tuning-from "$TUNE" --ddp-reference "$TUNE" \
             --out $OUT/asr_2x2_100mbit_25ms.json ;;
    *) echo "unknown race $r (tune low mid high slow sites)" >&2; exit 2 ;;
  esac
done
# the docs' race parts from the records (benchmarks/race/docs.py reads fair/; the records of
# this campaign are in regimes/, for the tables by R of issue 47's deliverable 6)
"$PY" -m benchmarks.race.docs
