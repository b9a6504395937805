#!/usr/bin/env bash
# Compatibility check in a second environment, built outside the repository, the way a GPU
# container is set up (README, "GPU cluster"):
#   1. a venv from Python 3.12 (or COMPAT_PYTHON=3.10, the oldest supported Python) with the
#      newest torch, megatron-core, transformers and ray on the registry for that Python (the
#      "container stack"; COMPAT_PINS picks other versions);
#   2. this project with `pip install --no-deps -e .` and scripts/container-requirements.txt,
#      plus the test extra; the stack must come out unchanged, and `pip check` clean;
#   3. `python -m mcore_dpo.doctor`, which must exit 0;
#   4. a focused part of the suite:
#        parity at (tp, pp, dp) = (2, 2, 1) and (1, 2, 2)   scripts/compat_suite.py
#        one conversion round trip (HF -> tp2 pp2 -> tp1 pp4 -> HF, identical)
#        MoE parity with experts split over ep 2 (tp1 pp2 dp2; megatron-core's MoE layer and expert groups)
#        --save-format torch_dist training checkpoints (dist_checkpointing.save, resume, megatron-core's load)
#        a checkpoint megatron-core's dist_checkpointing.save writes as Megatron-LM does, converted to HF
#        the tp4 x pp2 run as 8 Ray actors (equal to one rank)
#        exact resume after a killed rank (tp2 pp2, and dp2)
#   and prints a summary (versions, each test's result, times). Not part of .ci/run.
#   COMPAT_RAY=oldest|newest takes Ray at one end of setup.py's range (its oldest release, or the
#   newest below its cap) and runs the Ray tests instead: launch, placement, restarts, a lost node
#   and the local cluster's process lifetime (RAY_TESTS below), unless COMPAT_TESTS names others.
#
#   bash scripts/compat_check.sh          # first run: ~4 GB of CUDA wheels into pip's cache
#   COMPAT_PYTHON=3.10 bash scripts/compat_check.sh   # Python 3.10: torch 2.14, megatron-core 0.16, transformers 5.20
#   COMPAT_VENV=/path/venv PYTHON=/path/python3.12 bash scripts/compat_check.sh
#   PYTHON=python3.11 COMPAT_PINS="megatron-core==0.16.1 torch==2.13.0" bash scripts/compat_check.sh
#   COMPAT_REUSE=1 bash scripts/compat_check.sh   # keep an existing venv's stack (after a code change)
#   COMPAT_TESTS="tests/test_x.py::test_y ..." bash scripts/compat_check.sh   # another set of tests
#   PYTHON=python3.11 COMPAT_RAY=oldest COMPAT_PINS="torch==2.13.0 megatron-core==0.16.1" bash scripts/compat_check.sh
#
# The summary is also written to $COMPAT_VENV/summary.txt; docs/results/compatibility_runs.md records runs
# (docs/COMPATIBILITY.md sums them up).
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
PYTHON=${PYTHON:-}
WANT=${COMPAT_PYTHON:-3.12}  # the interpreter looked for when PYTHON is not given
case "$WANT" in
  3.10|3.11|3.12) ;;
  *) echo "compat_check: COMPAT_PYTHON=$WANT: expected 3.10, 3.11 or 3.12" >&2; exit 2 ;;
esac
RAY_END=${COMPAT_RAY:-}
case "$RAY_END" in
  ""|oldest|newest) ;;
  *) echo "compat_check: COMPAT_RAY=$RAY_END: expected oldest or newest" >&2; exit 2 ;;
esac
if [ -z "$PYTHON" ]; then
  for candidate in "python$WANT" "${PYENV_ROOT:-$HOME/.pyenv}"/versions/"$WANT".*/bin/python; do
    if "$candidate" -c "import sys; assert sys.version_info[:2] == (3, ${WANT#3.})" 2>/dev/null; then PYTHON=$candidate; break; fi
  done
fi
if [ -z "$PYTHON" ] || ! "$PYTHON" -c 'import sys; assert (3, 10) <= sys.version_info[:2] <= (3, 12)' 2>/dev/null; then
  echo "compat_check: no Python 3.10-3.12 interpreter (default: python$WANT; set PYTHON=/path/to/python)" >&2
  exit 2
fi
VENV=${COMPAT_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/mcore_dpo/compat-venv$("$PYTHON" -c 'import sys; print(f"{sys.version_info[0]}{sys.version_info[1]}")')${RAY_END:+-ray-$RAY_END}}
case "$(cd "$(dirname "$VENV")" 2>/dev/null && pwd || dirname "$VENV")/" in
  "$REPO"/*) echo "compat_check: COMPAT_VENV=$VENV is inside the repository; put it outside" >&2; exit 2 ;;
esac
PINS=${COMPAT_PINS:-}
if [ -n "$RAY_END" ]; then
  # setup.py's ray requirement, e.g. ray>=2.50,<2.61: the oldest end is ray==2.50 (2.50.0), the
  # newest end the whole range (pip takes the newest release in it).
  RAY_RANGE=$("$PYTHON" - "$REPO/setup.py" <<'EOF'
import ast, sys
tree = ast.parse(open(sys.argv[1]).read())
call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "setup")
requires = next(ast.literal_eval(k.value) for k in call.keywords if k.arg == "install_requires")
print(next(r for r in requires if r.startswith("ray>=")))
EOF
)
  if [ "$RAY_END" = oldest ]; then RAY_PIN="ray==$(echo "$RAY_RANGE" | sed -E 's/^ray>=([^,]+),.*/\1/')"
  else RAY_PIN=$RAY_RANGE; fi
  PINS="$PINS $RAY_PIN"
fi
LOG="$VENV.log"
CORES=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)  # nproc reports OMP_NUM_THREADS when set
start=$(date +%s)

# A machine-wide pip constraint file (PIP_CONSTRAINT or pip.conf) may cap torch at a locally
# mirrored release; this environment takes the registry as it is.
export PIP_CONSTRAINT=/dev/null
export PIP_DISABLE_PIP_VERSION_CHECK=1

PY="$VENV/bin/python"
STACK="torch megatron-core transformers ray"
REUSE=0
if [ "${COMPAT_REUSE:-0}" = 1 ] && [ -x "$PY" ]; then
  REUSE=1
  echo "compat_check: reusing the stack in $VENV (log: $LOG)"
else
  echo "compat_check: building $VENV with $("$PYTHON" --version) (log: $LOG)"
  rm -rf "$VENV"
  mkdir -p "$(dirname "$VENV")"
  "$PYTHON" -m venv "$VENV"
fi
TEST_EXTRA=$("$PY" -c '
import ast, sys
tree = ast.parse(open(sys.argv[1]).read())
call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "setup")
extras = next(ast.literal_eval(k.value) for k in call.keywords if k.arg == "extras_require")
print(" ".join(extras["test"]))' "$REPO/setup.py")
# One chain: set -e does not apply inside a `|| ...` list, so each step gates the next.
# shellcheck disable=SC2086
{ { [ "$REUSE" = 1 ] || "$PY" -m pip install $STACK $PINS; } &&
  "$PY" -m pip freeze | sort > "$VENV/freeze-stack.txt" &&
  "$PY" -m pip install --no-deps -e "$REPO" &&
  "$PY" -m pip install -r "$REPO/scripts/container-requirements.txt" $TEST_EXTRA &&
  "$PY" -m pip freeze | sort > "$VENV/freeze-after.txt"; } > "$LOG" 2>&1 ||
  { tail -20 "$LOG"; echo "compat_check: install failed (see $LOG)" >&2; exit 1; }

changed=$(comm -23 "$VENV/freeze-stack.txt" "$VENV/freeze-after.txt" | grep -i -E '^(torch|megatron-core|transformers|ray)==' || true)
pip_check=$("$PY" -m pip check 2>&1) && pip_check_ok=1 || pip_check_ok=0
(cd /tmp && OMP_NUM_THREADS=1 PYTHONPATH="$REPO" "$PY" -m mcore_dpo.doctor) > "$VENV/doctor.txt" 2>&1 && doctor_ok=1 || doctor_ok=0
installed=$(date +%s)

export OMP_NUM_THREADS=1
export PYTHONPATH="$REPO"
# Cheapest first; -v with unbuffered output shows each result in pytest.txt as it comes.
TESTS=(
  "tests/test_convert_cli.py::test_reshard_tp2pp2_to_tp1pp4_to_hf_is_identical"
  "tests/test_moe.py::test_parity_expert_parallel_pp2_dp2_ep2"
  "tests/test_torch_dist_train.py::test_torch_dist_training_checkpoints"
  "tests/test_torch_dist_megatron.py::test_megatron_lm_checkpoint_converts_to_hf_bit_exactly"
  "scripts/compat_suite.py::test_parity_compat[tp1-pp2-dp2]"
  "tests/test_packing_run.py::test_packing_at_tp4_pp2_equals_tp1_pp1_and_resumes_exactly"
  "tests/test_resume.py::test_exact_resume_after_kill"
  "tests/test_resume.py::test_kill_during_checkpoint_write"
  "scripts/compat_suite.py::test_parity_compat[tp2-pp2-dp1]"
)
# COMPAT_RAY: what goes through Ray (actors, placement groups, restarts, a lost node, the local
# cluster's processes ending with the driver).
RAY_TESTS=(
  "tests/test_ray_placement.py"
  "tests/test_ray_launch.py"
  "tests/test_process_lifetime.py"
  "tests/test_resume.py::test_restarts_after_three_kills"
  "tests/test_resume.py::test_lost_node_restarts_on_the_remaining_node"
)
if [ -n "$RAY_END" ]; then TESTS=("${RAY_TESTS[@]}"); fi
if [ -n "${COMPAT_TESTS:-}" ]; then read -r -a TESTS <<< "$COMPAT_TESTS"; fi  # a subset, space-separated
cd "$REPO"
set +e
PYTHONUNBUFFERED=1 nice -n "${COMPAT_NICE:-10}" "$PY" -m pytest -v -p no:cacheprovider --junitxml="$VENV/junit.xml" "${TESTS[@]}" \
  > "$VENV/pytest.txt" 2>&1
test_status=$?
set -e
end=$(date +%s)

{
  echo "== compat_check summary ($(date -u +%Y-%m-%dT%H:%MZ), $(uname -m), $CORES cores)"
  if [ -n "$RAY_END" ]; then echo "ray: the $RAY_END end of $RAY_RANGE ($RAY_PIN)"; fi
  if [ -n "$PINS" ]; then echo "pins:$PINS"; fi
  "$PY" - <<'EOF'
import platform
from importlib.metadata import version
print(f"python {platform.python_version()}")
for name in ("torch", "megatron-core", "transformers", "ray", "datasets", "safetensors", "tensorboard", "matplotlib", "numpy", "pytest"):
    print(f"{name} {version(name)}")
EOF
  if [ -z "$changed" ]; then echo "stack unchanged by installing the project: yes"
  else echo "stack unchanged by installing the project: NO, replaced:"; echo "$changed"; fi
  if [ "$pip_check_ok" = 1 ]; then echo "pip check: $pip_check"; else echo "pip check: FAILED"; echo "$pip_check"; fi
  if [ "$doctor_ok" = 1 ]; then echo "doctor: exit 0"; else echo "doctor: FAILED"; fi
  sed 's/^/  | /' "$VENV/doctor.txt"
  "$PY" - "$VENV/junit.xml" <<'EOF'
import sys
import xml.etree.ElementTree as ET
try:
    root = ET.parse(sys.argv[1]).getroot()
except (OSError, ET.ParseError) as error:
    print(f"tests: no report ({error})")
    raise SystemExit(0)
for case in root.iter("testcase"):
    outcome = "PASS"
    for tag in ("failure", "error", "skipped"):
        if case.find(tag) is not None:
            outcome = tag.upper()
    print(f"{outcome:8s} {case.get('classname')}::{case.get('name')}  {float(case.get('time', 0)):.0f} s")
EOF
  tail -1 "$VENV/pytest.txt"
  echo "time: install $((installed - start)) s, tests $((end - installed)) s"
} | tee "$VENV/summary.txt"

if [ "$test_status" -ne 0 ] || [ -n "$changed" ] || [ "$pip_check_ok" != 1 ] || [ "$doctor_ok" != 1 ]; then
  echo "compat_check: FAILED (pytest output: $VENV/pytest.txt)" >&2
  exit 1
fi
echo "compat_check: passed"
