#!/usr/bin/env bash
# Speculative decoding on a copying workload, octavo against llama.cpp's llama-server with its
# own draft-free speculation: the same bfloat16 GGUF file, the same client (`octavo bench
# serve --prompt-format grounded`: prompts that ask to repeat or edit a given passage), at
# concurrency 1, 8 and 32 (--concurrency), one fresh server per configuration and round. Not part of CI. Run it
# after `benchmarks/compare.sh` has built llama-server and converted the model (it reads both
# from compare.sh's cache), from the repository after `make setup`:
#
#     benchmarks/spec_grounded.sh                 # 2 rounds, every configuration below
#     benchmarks/spec_grounded.sh --rounds 1 --octavo none,suffix --llama none,ngram-mod
#     benchmarks/spec_grounded.sh --octavo none,ngram4,suffix4 --llama none   # 4 proposed
#
# Configurations: octavo's --speculative-config per name in OCTAVO_CONFIGS, llama-server's
# --spec-type flags per name in LLAMA_CONFIGS ("none": no speculation). Prints one line per
# run and writes the client's JSON per run into --results.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CACHE=${OCTAVO_COMPARE_CACHE:-$HOME/.cache/octavo-compare}
OCTAVO_PY=${OCTAVO_PY:-$REPO/.venv/bin/python}
LLAMA_SERVER=${LLAMA_SERVER:-$CACHE/llama-build/bin/llama-server}
GGUF=${GGUF:-$(ls "$CACHE"/models/*-gguf/*.gguf 2>/dev/null | head -1)}
NCPU=$(nproc)
PORT=8321
ROUNDS=2
CONCURRENCY="1 8 32"
RESULTS=${RESULTS:-/tmp/octavo-spec-grounded}
OCTAVO_NAMES=none,ngram,suffix
LLAMA_NAMES=none,ngram-simple,ngram-mod

declare -A OCTAVO_CONFIGS=(
    [none]=""
    [ngram]='{"method":"ngram","num_speculative_tokens":8,"prompt_lookup_min":2,"prompt_lookup_max":8}'
    [suffix]='{"method":"suffix","num_speculative_tokens":8}'
    # Shorter proposals: where a verified row costs nearly a decode row of compute (no AMX).
    [ngram4]='{"method":"ngram","num_speculative_tokens":4,"prompt_lookup_min":2,"prompt_lookup_max":8}'
    [suffix4]='{"method":"suffix","num_speculative_tokens":4}'
)
# llama.cpp's n-gram types with their own defaults, draft length 8 where it is a setting.
declare -A LLAMA_CONFIGS=(
    [none]=""
    [ngram-simple]="--spec-type ngram-simple --spec-ngram-simple-size-m 8"
    [ngram-mod]="--spec-type ngram-mod"
    [ngram-map-k]="--spec-type ngram-map-k"
)

while [ $# -gt 0 ]; do
    case $1 in
        --rounds) ROUNDS=$2; shift 2 ;;
        --concurrency) CONCURRENCY=${2//,/ }; shift 2 ;;
        --octavo) OCTAVO_NAMES=$2; shift 2 ;;
        --llama) LLAMA_NAMES=$2; shift 2 ;;
        --results) RESULTS=$2; shift 2 ;;
        --gguf) GGUF=$2; shift 2 ;;
        -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
        *) echo "unknown option $1" >&2; exit 2 ;;
    esac
done
[ -f "$GGUF" ] || { echo "no GGUF: run benchmarks/compare.sh first or pass --gguf" >&2; exit 2; }
mkdir -p "$RESULTS"
log() { echo "[spec-grounded $(date +%H:%M:%S)] $*" >&2; }
log "CPU: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $NCPU CPUs; file $GGUF"

SERVER_PID=""
stop_server() {
    [ -n "$SERVER_PID" ] || return 0
    kill -TERM -- "-$SERVER_PID" 2>/dev/null || true
    for _ in $(seq 30); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 1; done
    kill -KILL -- "-$SERVER_PID" 2>/dev/null || true
    wait "$SERVER_PID" 2>/dev/null || true
    SERVER_PID=""
}
trap stop_server EXIT

start_server() {  # engine configuration
    local engine=$1 name=$2 log_file="$RESULTS/$1-$2.log"
    if [ "$engine" = octavo ]; then
        local spec=()
        [ -z "${OCTAVO_CONFIGS[$name]}" ] || spec=(--speculative-config "${OCTAVO_CONFIGS[$name]}")
        setsid "$OCTAVO_PY" -m octavo.entrypoints.cli serve "$GGUF" --port "$PORT" \
            --max-model-len 2048 --kv-cache-tokens 32768 "${spec[@]}" > "$log_file" 2>&1 &
    else
        # Per-slot KV for 32 slots (compare.sh's calibration finds it llama.cpp's faster mode).
        # shellcheck disable=SC2086
        setsid "$LLAMA_SERVER" -m "$GGUF" --port "$PORT" -c 65536 -np 32 -t "$NCPU" \
            -tb "$NCPU" --no-webui ${LLAMA_CONFIGS[$name]} > "$log_file" 2>&1 &
    fi
    SERVER_PID=$!
    local start=$SECONDS
    until curl -sf "http://127.0.0.1:$PORT/health" > /dev/null 2>&1; do
        kill -0 "$SERVER_PID" 2>/dev/null || { tail -20 "$log_file" >&2; return 1; }
        [ $((SECONDS - start)) -lt 900 ] || { log "$engine not ready after 900 s"; return 1; }
        sleep 2
    done
}

bench() {  # concurrency prompts out
    # The client exits 1 when a request failed; its JSON line still counts them ("failed"),
    # and the run goes on. Its first error goes to the log.
    local report
    report=$("$OCTAVO_PY" -m octavo.entrypoints.cli bench serve --base-url "http://127.0.0.1:$PORT" \
        --prompt-format grounded --input-len 256 --output-len 128 --ignore-eos \
        --num-prompts "$2" --max-concurrency "$1") || true
    grep -m1 "requests failed; first error" <<< "$report" >&2 || true
    tail -1 <<< "$report" > "$3"
}

# octavo's speculation counters (vLLM's names) in the server's /metrics, as "drafts draft
# tokens accepted tokens"; nothing from a server without them (llama-server).
spec_counters() {
    curl -sf "http://127.0.0.1:$PORT/metrics" 2>/dev/null | "$OCTAVO_PY" -c '
import sys
totals = {"num_drafts": 0.0, "num_draft_tokens": 0.0, "num_accepted_tokens": 0.0}
for line in sys.stdin:
    for name in totals:
        if line.startswith("vllm:spec_decode_" + name + "_total"):
            totals[name] += float(line.split()[-1])
print(" ".join("%d" % v for v in totals.values()))' || true
}

for round in $(seq "$ROUNDS"); do
    for engine in octavo llamacpp; do
        names=$OCTAVO_NAMES
        [ "$engine" = octavo ] || names=$LLAMA_NAMES
        for name in ${names//,/ }; do
            start_server "$engine" "$name"
            bench 1 4 /dev/null  # warm-up
            for concurrency in $CONCURRENCY; do
                prompts=$((concurrency == 1 ? 8 : 4 * concurrency))
                out="$RESULTS/$engine-$name-c$concurrency-r$round.json"
                before=$(spec_counters)
                bench "$concurrency" "$prompts" "$out"
                after=$(spec_counters)
                log "$engine $name c=$concurrency r$round: $("$OCTAVO_PY" -c '
import json, sys
r = json.load(open(sys.argv[1]))
line = "TPOT p50 %.2f ms, %.1f out tok/s, %d failed" % (
    r["median_tpot_ms"], r["output_throughput"], r["failed"])
before, after = sys.argv[2].split(), sys.argv[3].split()
if before and after:
    drafts, drafted, accepted = (int(a) - int(b) for a, b in zip(after, before))
    if drafts:
        line += ", %d of %d drafted tokens accepted, mean acceptance length %.2f" % (
            accepted, drafted, 1 + accepted / drafts)
print(line)
' "$out" "$before" "$after")"
            done
            stop_server
        done
    done
done
