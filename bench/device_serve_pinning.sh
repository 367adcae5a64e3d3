#!/usr/bin/env bash
# Served vs offline at C = 256 on a random SmolLM2-shaped model, twice free and twice with the
# engine, server and load generator pinned to distinct physical cores (device_serve_ab.sh's
# ENGINE_CPUS / SERVER_CPUS / CLIENT_CPUS). Carry .whl, .data and .carry/tok. Results under $OUT.
source bench/device_setup.sh
python3 bench/random_smollm2.py --out /tmp/rs --tokenizer .carry/tok > /dev/null 2>&1
mkdir -p /tmp/data && cp .data/* /tmp/data/
lscpu -e=CPU,CORE,SOCKET,NODE > $OUT/topology.txt; nvidia-smi topo -m >> $OUT/topology.txt 2>&1
# one CPU of each physical core, in order
phys=($(lscpu -p=CPU,CORE | grep -v '^#' | sort -t, -k2,2n -u | cut -d, -f1))
echo "physical: ${phys[*]}" >> $OUT/topology.txt
base=$OUT
OUT=$base/free MODEL=/tmp/rs PROMPTS_DIR=/tmp/data LEVELS=256 OFFLINE_REPEATS=3 bash bench/device_serve_ab.sh "a|" "b|" 2>&1 | tail -3
OUT=$base/pin ENGINE_CPUS=${phys[0]},${phys[1]} SERVER_CPUS=${phys[2]},${phys[3]} CLIENT_CPUS=${phys[4]},${phys[5]},${phys[6]},${phys[7]} MODEL=/tmp/rs PROMPTS_DIR=/tmp/data LEVELS=256 OFFLINE_REPEATS=3 bash bench/device_serve_ab.sh "a|" "b|" 2>&1 | tail -3
head -3 $base/topology.txt; tail -1 $base/topology.txt
