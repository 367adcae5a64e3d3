#!/usr/bin/env bash
# Realised step costs on the H200, real model (assembled by .carry/assemble.sh): the closed-loop
# sweep of bench/device_issue6_sweep.sh over plain decoding, the policy with the shipped table,
# and the same with "realised_costs". Results under $OUT.
#
#   TEMPERATURE=0 LEVELS=64,256 REPEATS=2 bash bench/device_realised_costs.sh
set -u
export ARMS_JSON='{"plain": null, "k7": {"method": "dspark", "scheduling": false},
  "shipped": {"method": "dspark"},
  "realised": {"method": "dspark", "realised_costs": true}}'
LEVELS=${LEVELS:-64,256} bash bench/device_issue6_sweep.sh
