#!/usr/bin/env bash
# The prepared device check: the CUDA paths of areal_async on one GPU machine, in about 6 minutes, from the working
# tree alone (no network, nothing installed but the wheels of benchmarks/gpu_wheels.sh in .whl/).
#
#   bash benchmarks/gpu_wheels.sh        # once, on a machine with PyPI: the missing packages into .whl/
#   bash benchmarks/gpu_check.sh         # on the GPU machine (the repository root travels with .whl/ in it)
#   bash benchmarks/gpu_check.sh --cpu   # the same checks with CUDA hidden (also what happens without a GPU)
#
# Steps, each under `timeout` inside one overall budget, so a hang costs at most its own share:
#   setup       the Python to use, the wheels (only where a package is missing), the project on PYTHONPATH, and the
#               versions: torch, CUDA, the GPU. A GPU that nvidia-smi lists but torch cannot use is a failure.
#   unbound_group
#               benchmarks/gpu_probe.py unbound (CUDA only, NCCL_DEBUG=INFO): default nccl group of world 1 bound to
#               cuda:0, the weight-update group made with nccl, one broadcast; the default backend's
#               comm_split_count() must still be 0 (the regression check for the group split from the trainers').
#   real_shape  benchmarks/gpu_probe.py real_shape (CUDA only): a random checkpoint of Qwen2.5-1.5B's shape built on
#               the device (no download); the LM head at the real vocabulary, train-step peak memory, decode
#               tokens/s of the embedded engine, and the full weights through the broadcast path, with GB/s.
#   base_model  `python -m areal_async.tasks.base_model`: the tiny base model (model.path=tiny) built into a cache
#               under /tmp, on CUDA where there is one (the code's default), in the background beside gpu_tests.
#   gpu_tests   `pytest -m gpu tests/test_gpu_train.py tests/test_gpu_e2e.py`: bf16 train step, nccl broadcast
#               between two processes (two GPUs), flash-attention packing (flash-attn installed), the embedded
#               server on CUDA against transformers (test_run_on_cuda is deselected: the runs below are the same);
#               each test is reported on its own.
#   run_disk, run_broadcast
#               `python -m areal_async.run model.path=tiny ... total_steps=4` with each weight sync: the default base
#               model (a random tiny checkpoint if its build failed), run dirs kept (weights left out). During
#               run_broadcast the NCCL_CUMEM_ENABLE of every server and trainer process is read from
#               /proc/<pid>/environ (what each inherited), and after it from their logs (what each set before torch
#               loaded: server/cli.py and train/worker.py log it); trainer and server must agree.
#
# Writes to $OUT (default ./gpu_check_out): summary.json (each check: passed/failed/skipped, seconds, the tail of
# its log on failure; versions and GPU), gpu_check.log (what this script printed, the table last), pytest.log,
# base_model.log, runs.tar.gz (both run dirs and their output) and pytest_runs.tar.gz (the gpu tests' run dirs),
# probe_*.json and probe_*.log (gpu_probe.py, with the NCCL debug lines), topo.txt (nvidia-smi topo -m), pip_list.txt.
# Exit status 0 when no check failed.
#
# Environment: OUT; PYTHON (default ./.venv/bin/python if present, else python3); AREAL_CACHE (default
# /tmp/gpu_check/cache); GPU_CHECK_WORK (scratch, default /tmp/gpu_check); GPU_CHECK_BUDGET_S (seconds for all
# steps: 345 with a GPU, so that the whole call stays under 6 minutes; 900 on CPU); GPU_CHECK_BASE_DEVICE=cpu
# builds the base model on the CPU instead.
set -uo pipefail
# The whole script is one { ... } block: bash reads all of it before running any, so an edit or a checkout of this
# file while it runs cannot change what runs.
{

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT" || exit 2

FORCE_CPU=0
for arg in "$@"; do
    case "$arg" in
        --cpu) FORCE_CPU=1 ;;
        -h|--help) sed -n '2,/^set -uo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) echo "unknown argument: $arg (try --help)" >&2; exit 2 ;;
    esac
done

OUT=${OUT:-$ROOT/gpu_check_out}
WORK=${GPU_CHECK_WORK:-/tmp/gpu_check}
export AREAL_CACHE=${AREAL_CACHE:-$WORK/cache}
mkdir -p "$OUT" "$WORK" "$AREAL_CACHE" || exit 2
OUT=$(cd "$OUT" && pwd)
# a rerun on a warm machine keeps the base model cache and the installed wheels, nothing else
rm -rf "$WORK/pytest" "$WORK/run_disk" "$WORK/run_broadcast" "$WORK/random_ckpt" "$WORK/steps.tsv" \
    "$WORK/pytest.xml" "$WORK/env.json" "$WORK/base_model.path" "$WORK"/*.out "$WORK"/*.err \
    "$WORK/qwen2.5-1.5b-shape" "$WORK"/probe_*.json "$WORK/cumem.tsv"
rm -f "$OUT/summary.json" "$OUT/gpu_check.log" "$OUT/pytest.log" "$OUT/base_model.log" "$OUT/runs.tar.gz" \
    "$OUT/pytest_runs.tar.gz" "$OUT"/probe_*.json "$OUT"/probe_*.log "$OUT/topo.txt" "$OUT/pip_list.txt"
LOG="$OUT/gpu_check.log"
STEPS="$WORK/steps.tsv"
: >"$STEPS"
TAG="gpu-check-$$-$(date +%s)"  # marks the processes of each step, so leftovers can be ended by their ids
START=$SECONDS

export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TQDM_DISABLE=1 \
    MPLBACKEND=Agg
if [[ $FORCE_CPU == 1 ]]; then export CUDA_VISIBLE_DEVICES=""; fi

say() { printf '%s\n' "$*" | tee -a "$LOG"; }
elapsed() { echo $((SECONDS - START)); }
now() { date +%s.%N; }

# step_timeout MAX RESERVE: MAX seconds, or less so that RESERVE seconds of the budget stay for what follows
step_timeout() {
    local left=$((BUDGET - $(elapsed) - $2))
    if ((left < $1)); then echo "$left"; else echo "$1"; fi
}

# record NAME STATUS SECONDS RC LOG NOTE
record() {
    printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" "$5" "${6//$'\t'/ }" >>"$STEPS"
    say "[$(elapsed)s] $1: $2 (${3}s, exit $4)${6:+ - $6}"
}

# run_step NAME TIMEOUT LOGFILE CMD...: run CMD with the step's tag under timeout; sets STEP_RC and STEP_S
run_step() {
    local name=$1 limit=$2 logf=$3 t0
    shift 3
    t0=$(now)
    env GPU_CHECK_TAG="$TAG-$name" timeout -k 10 "$limit" "$@" >"$logf" 2>&1
    STEP_RC=$?
    STEP_S=$(awk -v a="$t0" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }')
    reap "$name"
}

# tagged NAME: the pids of processes that carry step NAME's tag (this shell carries none)
tagged() {
    local want="GPU_CHECK_TAG=$TAG-$1" p
    for p in /proc/[0-9]*; do
        [[ -r $p/environ ]] || continue
        if { tr '\0' '\n' <"$p/environ"; } 2>/dev/null | grep -qxF "$want"; then echo "${p#/proc/}"; fi
    done
}

# reap NAME: end what a step left running (a server or trainer in a session of its own), by pid
reap() {
    local pids
    mapfile -t pids < <(tagged "$1")
    ((${#pids[@]})) || return 0
    say "  ending ${#pids[@]} process(es) left by $1: ${pids[*]}"
    kill -TERM "${pids[@]}" 2>/dev/null
    sleep 3
    mapfile -t pids < <(tagged "$1")
    ((${#pids[@]})) && kill -KILL "${pids[@]}" 2>/dev/null
    return 0
}

timed_out() { [[ $1 == 124 || $1 == 137 ]]; }

# ---- setup --------------------------------------------------------------------------------------------------------
say "gpu_check: $ROOT -> $OUT (scratch $WORK, cache $AREAL_CACHE)"
PY=${PYTHON:-}
if [[ -z "$PY" ]]; then
    if [[ -x "$ROOT/.venv/bin/python" ]]; then PY="$ROOT/.venv/bin/python"; else PY=$(command -v python3 || echo python3); fi
fi
SITE="$WORK/site"
export PYTHONPATH="$SITE:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
BUDGET=${GPU_CHECK_BUDGET_S:-345}  # refined below once we know whether there is a GPU
SETUP_LOG="$WORK/setup.out"
t0=$(now)
setup_note=""
(
    set -e
    echo "python: $PY"
    timeout -k 5 30 "$PY" -c 'import sys; print(sys.version)'
    # the packages the project and its gpu tests import; the wheels in .whl/ cover the ones the GPU image lacks
    mods=(torch transformers aiohttp uvloop msgspec numpy yaml safetensors tokenizers jinja2 math_verify gguf
          accelerate matplotlib tensorboard pyarrow pytest pytest_asyncio pytest_timeout)
    missing_modules() {
        timeout -k 5 30 "$PY" -c 'import importlib.util, sys
print(" ".join(m for m in sys.argv[1:] if importlib.util.find_spec(m) is None))' "${mods[@]}"
    }
    missing=$(missing_modules)
    if [[ -n "$missing" ]]; then
        echo "missing: $missing"
        shopt -s nullglob
        wheels=("$ROOT"/.whl/*.whl)
        if ((${#wheels[@]} == 0)); then
            echo "no wheels in $ROOT/.whl (run benchmarks/gpu_wheels.sh where PyPI is reachable)"
            exit 3
        fi
        timeout -k 5 90 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
            "${wheels[@]}"
        echo "installed ${#wheels[@]} wheel(s) into $SITE"
        missing=$(missing_modules)
        if [[ -n "$missing" ]]; then echo "still missing after the wheels: $missing"; exit 3; fi
    fi
    timeout -k 5 60 "$PY" -c 'import areal_async.run, areal_async.serve, areal_async.train.worker, areal_async.tasks.base_model'
    timeout -k 5 60 "$PY" - "$WORK/env.json" "$ROOT" <<'PYEOF'
import importlib.metadata as md
import json
import os
import platform
import shutil
import subprocess
import sys

import torch

def version(dist):
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None

env = {"python": sys.version.split()[0], "executable": sys.executable, "platform": platform.platform(),
       "cpus": os.cpu_count(), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
       "cuda_available": torch.cuda.is_available(), "gpu_count": torch.cuda.device_count(),
       "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
       **{d: version(d) for d in ("transformers", "accelerate", "aiohttp", "msgspec", "numpy", "pytest",
                                  "pytest-asyncio", "flash-attn", "triton")}}
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    env.update(gpu_name=p.name, gpu_capability=f"{p.major}.{p.minor}", gpu_memory_gib=round(p.total_memory / 2**30, 1),
               cudnn=torch.backends.cudnn.version(), bf16_supported=torch.cuda.is_bf16_supported())
    try:
        env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception as e:  # a torch built without nccl
        env["nccl"] = f"unavailable ({e})"
if shutil.which("nvidia-smi"):
    q = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                       capture_output=True, text=True, timeout=30)
    env["nvidia_smi"] = q.stdout.strip().splitlines() if q.returncode == 0 else f"exit {q.returncode}: {q.stderr[-300:]}"
try:
    env["git_commit"] = subprocess.run(["git", "-C", sys.argv[2], "rev-parse", "HEAD"], capture_output=True,
                                       text=True, timeout=10).stdout.strip() or None
except OSError:
    env["git_commit"] = None
with open(sys.argv[1], "w") as f:
    json.dump(env, f, indent=1)
print(json.dumps(env, indent=1))
PYEOF
) >"$SETUP_LOG" 2>&1
setup_rc=$?
setup_s=$(awk -v a="$t0" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }')
cat "$SETUP_LOG" >>"$LOG"
MODE=cpu
if [[ $setup_rc == 0 ]]; then
    if "$PY" -c 'import json, sys; sys.exit(0 if json.load(open(sys.argv[1]))["cuda_available"] else 1)' \
        "$WORK/env.json"; then
        MODE=cuda
    elif [[ $FORCE_CPU == 0 ]] && command -v nvidia-smi >/dev/null \
        && timeout -k 5 20 nvidia-smi -L 2>/dev/null | grep -q GPU; then
        setup_rc=4
        setup_note="nvidia-smi lists a GPU but torch.cuda.is_available() is False (driver or torch build mismatch?)"
    fi
fi
BASE_MAX=200  # seconds for the base model build: on the GPU it runs beside the gpu tests
if [[ $MODE == cpu ]]; then
    BASE_MAX=600  # one CPU thread (the build's fixed setting) takes 2 to 4 minutes
    if [[ -z ${GPU_CHECK_BUDGET_S:-} ]]; then BUDGET=900; fi
fi
if [[ $setup_rc == 0 ]]; then
    record setup passed "$setup_s" 0 "$SETUP_LOG" "mode $MODE, budget ${BUDGET}s"
else
    record setup failed "$setup_s" "$setup_rc" "$SETUP_LOG" "${setup_note:-see the log}"
fi

# ---- what one GPU proves: the unbound default group, real shapes (gpu_probe.py) ---------------------------------
command -v nvidia-smi >/dev/null && timeout -k 5 30 nvidia-smi topo -m >"$OUT/topo.txt" 2>&1
timeout -k 5 60 "$PY" -m pip list >"$OUT/pip_list.txt" 2>&1
for probe in unbound real_shape; do
    name=$([[ $probe == unbound ]] && echo unbound_group || echo real_shape)
    if [[ $setup_rc != 0 ]]; then record "$name" skipped 0 - - "setup failed"; continue; fi
    if [[ $MODE != cuda ]]; then record "$name" skipped 0 - - "no CUDA device"; continue; fi
    limit=$(step_timeout "$([[ $probe == unbound ]] && echo 45 || echo 120)" 150)
    if ((limit < 15)); then record "$name" skipped 0 - - "no time left in the ${BUDGET}s budget"; continue; fi
    say "[$(elapsed)s] $name: benchmarks/gpu_probe.py $probe (timeout ${limit}s)"
    run_step "$name" "$limit" "$WORK/probe_$probe.out" env NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,ENV \
        "$PY" benchmarks/gpu_probe.py "$probe" "$WORK/probe_$probe.json"
    cp "$WORK/probe_$probe.out" "$OUT/probe_$probe.log" 2>/dev/null
    [[ -f "$WORK/probe_$probe.json" ]] && cp "$WORK/probe_$probe.json" "$OUT/"
    record "$name" probe "$STEP_S" "$STEP_RC" "$WORK/probe_$probe.out" \
        "$(timed_out "$STEP_RC" && echo "timed out after ${limit}s" || echo "probe_$probe.json")"
done

# cumem_watch NAME FILE: while step NAME runs, note each of its server and trainer processes' inherited
# NCCL_CUMEM_ENABLE (from /proc/<pid>/environ) in FILE as "pid<TAB>role<TAB>value"
cumem_watch() {
    local p role val
    while :; do
        for p in $(tagged "$1"); do
            grep -q "^$p"$'\t' "$2" 2>/dev/null && continue
            role=""
            # a process gone since `tagged` listed it: the redirection's own error is silenced too (braces)
            case "$({ tr '\0' ' ' <"/proc/$p/cmdline"; } 2>/dev/null)" in
                *areal_async.serve*|*sglang.launch_server*) role=server ;;
                *areal_async.train.worker*) role=trainer ;;
            esac
            [[ -z $role ]] && continue
            val=$({ tr '\0' '\n' <"/proc/$p/environ"; } 2>/dev/null | sed -n 's/^NCCL_CUMEM_ENABLE=//p')
            printf '%s\t%s\t%s\n' "$p" "$role" "${val:-<unset>}" >>"$2"
        done
        sleep 1
    done
}

# ---- base model (background) and gpu tests ----------------------------------------------------------------------
BASE_OUT="$WORK/base_model.out"
PYTEST_OUT="$WORK/pytest.out"
base_ok=0
test_limit=$(step_timeout 150 80)
if [[ $setup_rc == 0 ]] && ((test_limit < 20)); then
    for name in base_model gpu_tests; do record "$name" skipped 0 - - "no time left in the ${BUDGET}s budget"; done
elif [[ $setup_rc == 0 ]]; then
    base_limit=$(step_timeout "$BASE_MAX" 80)
    base_env=()
    if [[ ${GPU_CHECK_BASE_DEVICE:-} == cpu ]]; then base_env=(CUDA_VISIBLE_DEVICES=); fi
    say "[$(elapsed)s] base_model: building in the background (timeout ${base_limit}s) -> $AREAL_CACHE"
    base_t0=$(now)
    env GPU_CHECK_TAG="$TAG-base_model" "${base_env[@]}" timeout -k 10 "$base_limit" \
        "$PY" -m areal_async.tasks.base_model --cache-dir "$AREAL_CACHE" >"$WORK/base_model.path" 2>"$BASE_OUT" &
    base_pid=$!

    say "[$(elapsed)s] gpu_tests: pytest -m gpu (timeout ${test_limit}s)"
    # test_run_on_cuda is left to run_disk / run_broadcast below (the same 4-step runs, checked more closely)
    run_step gpu_tests "$test_limit" "$PYTEST_OUT" "$PY" -m pytest -m gpu -v -rA -p no:cacheprovider \
        --basetemp="$WORK/pytest" --junitxml="$WORK/pytest.xml" -k "not test_run_on_cuda" \
        tests/test_gpu_train.py tests/test_gpu_e2e.py
    # the summary reads each test's outcome (from the junit XML, or from the log if pytest was killed)
    record gpu_tests pytest "$STEP_S" "$STEP_RC" "$PYTEST_OUT" \
        "$(timed_out "$STEP_RC" && echo "timed out after ${test_limit}s" || echo "pytest finished")"

    wait "$base_pid"
    base_rc=$?
    base_s=$(awk -v a="$base_t0" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }')
    reap base_model
    if [[ $base_rc == 0 ]]; then
        base_ok=1
        record base_model passed "$base_s" 0 "$BASE_OUT" "$(tail -n 1 "$WORK/base_model.path")"
    elif timed_out "$base_rc"; then
        record base_model failed "$base_s" "$base_rc" "$BASE_OUT" "timed out after ${base_limit}s"
    else
        record base_model failed "$base_s" "$base_rc" "$BASE_OUT" "see the log"
    fi
else
    for name in base_model gpu_tests; do record "$name" skipped 0 - - "setup failed"; done
fi

# ---- two 4-step runs ----------------------------------------------------------------------------------------------
MODEL=tiny
if [[ $setup_rc == 0 && $base_ok == 0 ]]; then
    MODEL="$WORK/random_ckpt"
    timeout -k 5 60 "$PY" -c 'import sys; from areal_async.testing.tiny import make_tiny_checkpoint
make_tiny_checkpoint(sys.argv[1], "qwen2", seed=0)' "$MODEL" >>"$LOG" 2>&1 \
        && say "  the runs use a random tiny checkpoint ($MODEL): no base model was built" \
        || MODEL=""
fi
for sync in disk broadcast; do
    name="run_$sync"
    if [[ $setup_rc != 0 || -z "$MODEL" ]]; then
        record "$name" skipped 0 - - "$([[ $setup_rc != 0 ]] && echo "setup failed" || echo "no model to run")"
        continue
    fi
    reserve=$([[ $sync == disk ]] && echo 40 || echo 0)
    limit=$(step_timeout 90 "$reserve")
    if ((limit < 15)); then
        record "$name" skipped 0 - - "no time left in the ${BUDGET}s budget"
        continue
    fi
    say "[$(elapsed)s] $name: 4 steps, train.weight_sync=$sync, model.path=$MODEL (timeout ${limit}s)"
    watch_pid=""
    if [[ $sync == broadcast ]]; then
        : >"$WORK/cumem.tsv"
        cumem_watch "$name" "$WORK/cumem.tsv" &
        watch_pid=$!
    fi
    run_step "$name" "$limit" "$WORK/$name.out" "$PY" -m areal_async.run "model.path=$MODEL" \
        "run_dir=$WORK/$name" mode=async eta=1 total_steps=4 schedule.batch_size=4 rollout.group_size=4 \
        rollout.max_new_tokens=64 eval.num_prompts=8 eval.max_new_tokens=16 schedule.eval_every=0 \
        data.num_train=200 data.num_eval=8 server.max_total_tokens=16384 "train.weight_sync=$sync"
    [[ -n $watch_pid ]] && { kill "$watch_pid" 2>/dev/null; wait "$watch_pid" 2>/dev/null; }
    timed_out "$STEP_RC" && say "  $name timed out after ${limit}s"
    record "$name" run "$STEP_S" "$STEP_RC" "$WORK/$name.out" "$MODEL"  # the summary checks its run dir
done

# ---- logs and the summary -----------------------------------------------------------------------------------------
[[ -f "$PYTEST_OUT" ]] && cp "$PYTEST_OUT" "$OUT/pytest.log"
[[ -f "$BASE_OUT" ]] && cp "$BASE_OUT" "$OUT/base_model.log"
# run dirs without weights and checkpoints (MBs each; the logs, metrics and summaries are what tell)
tar_logs() {
    local dest=$1
    shift
    (cd "$WORK" && tar -czf "$dest" --exclude='*.safetensors' --exclude='*.distcp' --exclude='*.bin' \
        --exclude='*.pt' --exclude='tensorboard' --exclude='*.png' --exclude='*.lock' "$@") 2>>"$LOG"
}
runs=()
for f in run_disk run_broadcast run_disk.out run_broadcast.out; do [[ -e "$WORK/$f" ]] && runs+=("$f"); done
((${#runs[@]})) && tar_logs "$OUT/runs.tar.gz" "${runs[@]}"
[[ -d "$WORK/pytest" ]] && tar_logs "$OUT/pytest_runs.tar.gz" pytest

SUMPY=$PY
"$SUMPY" -c '' 2>/dev/null || SUMPY=python3  # the summary needs only the standard library
"$SUMPY" - "$STEPS" "$WORK" "$OUT" "$MODE" "$BUDGET" "$(elapsed)" <<'PYEOF' 2>"$WORK/summary.err" | tee -a "$LOG"
import json
import os
import re
import sys
import xml.etree.ElementTree as ET

steps_file, work, out, mode, budget, total = sys.argv[1:7]


def tail(path, lines=60, chars=6000):
    try:
        with open(path, errors="replace") as f:
            text = f.read()
    except OSError:
        return None
    return "\n".join(text.splitlines()[-lines:])[-chars:]


def read(path):
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def pytest_checks(rc, seconds, log, note):
    """One check per gpu test from the junit XML (or, if pytest was killed, from the -v lines of its log)."""
    checks = []
    xml = os.path.join(work, "pytest.xml")
    if os.path.exists(xml):
        for case in ET.parse(xml).getroot().iter("testcase"):
            name = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
            entry = {"name": "gpu_test " + name, "status": "passed", "seconds": round(float(case.get("time", 0)), 1)}
            for child in case:
                if child.tag == "skipped":
                    entry.update(status="skipped", reason=child.get("message", ""))
                elif child.tag in ("failure", "error"):
                    entry.update(status="failed", reason=(child.get("message") or "")[:500],
                                 log_tail=(child.text or "")[-4000:])
            checks.append(entry)
    else:
        for m in re.finditer(r"^(tests/\S+::\S+) (PASSED|FAILED|SKIPPED|ERROR)", read(log), re.M):
            status = {"PASSED": "passed", "SKIPPED": "skipped"}.get(m.group(2), "failed")
            checks.append({"name": "gpu_test " + m.group(1), "status": status, "seconds": None})
    ran = [c["status"] for c in checks]
    if rc in (0, 1) and checks:
        status = "failed" if "failed" in ran else ("passed" if "passed" in ran else "skipped")
    else:  # 2-5: interrupted, internal error, usage error, nothing collected
        status = "failed"
    agg = {"name": "gpu_tests", "status": status, "seconds": seconds, "exit": rc, "log": "pytest.log",
           "counts": {s: ran.count(s) for s in ("passed", "failed", "skipped")}, "note": note}
    if status == "failed":
        agg["log_tail"] = tail(log)
    return [agg, *checks]


def nccl_cumem(run_dir):
    """NCCL_CUMEM_ENABLE per role: inherited (/proc/<pid>/environ during the run: the environment each process
    started with) and in force (the value server/cli.py and train/worker.py log before torch loads)."""
    inherited = []
    for line in read(os.path.join(work, "cumem.tsv")).splitlines():
        pid, role, value = (line.split("\t") + ["", "", ""])[:3]
        inherited.append({"pid": pid, "role": role, "value": value})
    logged = {"server": [], "trainer": []}
    logs = os.path.join(run_dir, "logs")
    for fname in sorted(os.listdir(logs)) if os.path.isdir(logs) else []:
        role = "server" if fname.startswith("server") else "trainer" if fname.startswith("trainer") else None
        if role:
            logged[role] += re.findall(r"NCCL_CUMEM_ENABLE=(\S+)", read(os.path.join(logs, fname)))
    return {"inherited": inherited, "logged": logged}


def probe_check(name, rc, seconds, log):
    """A gpu_probe.py step: its JSON verdict and figures, plus the NCCL debug lines of its log."""
    what = "unbound" if name == "unbound_group" else "real_shape"
    result = {}
    path = os.path.join(work, f"probe_{what}.json")
    if os.path.exists(path):
        result = json.loads(read(path) or "{}")
    entry = {"name": name, "seconds": seconds, "exit": rc, "log": f"probe_{what}.log", "result": result,
             "nccl_debug": [ln for ln in read(log).splitlines() if "NCCL INFO" in ln][:60]}
    if result.get("skipped"):
        entry.update(status="skipped", note=result["skipped"])
    elif result.get("ok") and rc == 0:
        entry["status"] = "passed"
    else:
        entry.update(status="failed", log_tail=tail(log))
    return entry


def run_check(name, rc, seconds, log, model):
    sync = name.split("_", 1)[1]
    run_dir = os.path.join(work, name)
    entry = {"name": name, "seconds": seconds, "exit": rc, "model": model, "log": f"runs.tar.gz:{name}.out"}
    problems = []
    summary = {}
    if os.path.exists(os.path.join(run_dir, "summary.json")):
        summary = json.loads(read(os.path.join(run_dir, "summary.json")) or "{}")
    if rc in (124, 137):
        problems.append(f"timed out (exit status {rc})")
    elif rc != 0:
        problems.append(f"exit status {rc}")
    if summary.get("steps") != 4 or summary.get("trained_samples") != 64 or not summary.get("completed"):
        problems.append(f"summary.json: steps {summary.get('steps')}, trained_samples "
                        f"{summary.get('trained_samples')}, completed {summary.get('completed')} (want 4, 64, true)")
    trainer_log = read(os.path.join(run_dir, "logs", "trainer.log"))
    dev = re.search(r"device (cuda:\d+|cpu)", trainer_log)
    entry["trainer_device"] = dev.group(1) if dev else None
    if mode == "cuda" and not (dev and dev.group(1).startswith("cuda")):
        problems.append(f"the trainer did not run on CUDA (trainer.log says device {entry['trainer_device']})")
    if sync == "broadcast":
        group = re.search(r"weight-update group \S+ \((\w+)\)", read(os.path.join(run_dir, "run.log")))
        entry["broadcast_backend"] = group.group(1) if group else None
        if not group:
            problems.append("run.log names no weight-update group")
        cumem = nccl_cumem(run_dir)
        entry["nccl_cumem"] = cumem
        logged = {role: sorted(set(vals)) for role, vals in cumem["logged"].items()}
        if not logged.get("server") or not logged.get("trainer"):
            problems.append(f"NCCL_CUMEM_ENABLE not logged by both ends: {logged}")
        elif logged["server"] != logged["trainer"] or len(logged["server"]) != 1:
            problems.append(f"trainer and server disagree on NCCL_CUMEM_ENABLE: {logged}")
    for key in ("wall_s", "base_accuracy", "final_accuracy", "max_staleness_seen", "trained_samples_per_s"):
        if key in summary:
            entry[key] = summary[key]
    if "timings" in summary:
        entry["timings"] = {k: round(v, 3) for k, v in summary["timings"].items() if isinstance(v, (int, float))}
    entry["status"] = "failed" if problems else "passed"
    if problems:
        entry["problems"] = problems
        entry["log_tail"] = "\n".join(filter(None, [tail(log, 40, 3000),
                                                    tail(os.path.join(run_dir, "logs", "trainer.log"), 30, 3000)]))
    return entry


checks = []
with open(steps_file) as f:
    rows = [line.rstrip("\n").split("\t") for line in f if line.strip()]
for name, status, seconds, rc, log, note in rows:
    seconds = float(seconds)
    rc = int(rc) if rc.lstrip("-").isdigit() else None
    if status == "pytest":
        checks.extend(pytest_checks(rc, seconds, log, note))
    elif status == "run":
        checks.append(run_check(name, rc, seconds, log, note))
    elif status == "probe":
        checks.append(probe_check(name, rc, seconds, log))
    else:
        entry = {"name": name, "status": status, "seconds": seconds, "exit": rc}
        if note:
            entry["note"] = note
        if status == "failed":
            entry["log_tail"] = tail(log)
        if name == "base_model" and status == "passed":
            marker = os.path.join(note, "areal_base_model.json")
            if os.path.exists(marker):
                built = json.loads(read(marker))
                entry.update(path=note, device=built.get("device"), sft_seconds=built.get("sft_seconds"),
                             final_loss=built.get("final_loss"),
                             cached="base model ready in" not in read(log))  # built by an earlier run
        checks.append(entry)

env = {}
if os.path.exists(os.path.join(work, "env.json")):
    env = json.loads(read(os.path.join(work, "env.json")))
env["topo"] = read(os.path.join(out, "topo.txt")) or None
env["pip_list"] = read(os.path.join(out, "pip_list.txt")).splitlines() or None
failed = [c["name"] for c in checks if c["status"] == "failed"]
summary = {"ok": not failed, "failed": failed, "mode": mode, "budget_s": int(budget), "total_s": int(total),
           "env": env, "checks": checks}
with open(os.path.join(out, "summary.json"), "w") as f:
    json.dump(summary, f, indent=1)

gpu = env.get("gpu_name") or "no GPU"
lines = [f"gpu_check: {'OK' if not failed else 'FAILED: ' + ', '.join(failed)}  ({mode}, {gpu}, torch "
         f"{env.get('torch')} CUDA {env.get('torch_cuda')}, {total}s of {budget}s)",
         f"{'check':<64} {'status':<8} {'seconds':>8}  note"]
for c in checks:
    sec = "" if c.get("seconds") is None else f"{c['seconds']:.1f}"
    note = c.get("note") or c.get("reason") or "; ".join(c.get("problems", []))
    if c["name"].startswith("run_") and c["status"] == "passed":
        note = (f"trainer {c.get('trainer_device')}, wall {c.get('wall_s', 0):.1f}s, acc "
                f"{c.get('base_accuracy')} -> {c.get('final_accuracy')}"
                + (f", {c['broadcast_backend']}" if c.get("broadcast_backend") else ""))
    if c["name"] == "base_model" and c["status"] == "passed":
        note = (f"{'found in the cache, ' if c.get('cached') else ''}built on {c.get('device')} in "
                f"{c.get('sft_seconds')}s, loss {c.get('final_loss')}")
    if c["name"] == "real_shape" and c["status"] != "skipped":
        r = c.get("result", {})
        parts = {k: v for k, v in r.items() if isinstance(v, dict) and "ok" in v}
        note = "; ".join(filter(None,
            [f"head {parts['lm_head'].get('fwd_bwd_s')}s" if parts.get("lm_head", {}).get("ok") else "",
             f"train peak {parts['train_step'].get('peak_gib')} GiB" if parts.get("train_step", {}).get("ok") else "",
             f"decode {parts['decode'].get('tokens_per_s')} tok/s" if parts.get("decode", {}).get("ok") else "",
             f"broadcast {parts['broadcast'].get('gb_per_s')} GB/s" if parts.get("broadcast", {}).get("ok") else ""]
            + [f"{k} FAILED" for k, v in parts.items() if not v.get("ok")]))
    if c["name"] == "unbound_group" and c["status"] != "skipped":
        r = c.get("result", {})
        note = f"comm_split_count {r.get('comm_split_count_before')} -> {r.get('comm_split_count_after')}"
    if c["name"] == "gpu_tests":
        note = ", ".join(f"{v} {k}" for k, v in c["counts"].items()) + ("" if c["exit"] in (0, 1) else
                                                                          f"; {c['note']}, exit {c['exit']}")
    shown = c["name"].replace("gpu_test tests/", "  ")
    lines.append(f"{shown[:64]:<64} {c['status']:<8} {sec:>8}  {' '.join(str(note).split())[:120]}")
proved = [c["name"] for c in checks if c["status"] == "passed"]
lines.append(f"proved here: {', '.join(proved) or 'nothing'}")
lines.append("not proved: " + "; ".join(
    [f"{c['name']} ({c['status']})" for c in checks if c["status"] != "passed"]
    + ["an nccl broadcast between two GPUs (the 2-GPU test), tensor-parallel SGLang, multi-node runs: need more "
       "than one GPU"]))
print("\n".join(lines))
sys.exit(1 if failed else 0)
PYEOF
rc=${PIPESTATUS[0]}
cat "$WORK/summary.err" >>"$LOG"
if [[ ! -s "$OUT/summary.json" ]]; then
    say "gpu_check: writing the summary failed (exit $rc; see $LOG)"
    exit 2
fi
exit "$rc"
}
