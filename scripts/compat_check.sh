#!/usr/bin/env bash
# Compatibility check in a second environment, built outside the repository:
#   Python 3.12 venv, the newest torch, megatron-core, transformers and ray on the registry,
#   this project installed from setup.py into it (which must accept those versions as they
#   are), `pip check`, then a focused part of the suite:
#     parity at (tp, pp, dp) = (2, 2, 1) and (1, 2, 2)   scripts/compat_suite.py
#     one conversion round trip (HF -> tp2 pp2 -> tp1 pp4 -> HF, identical)
#     the tp4 x pp2 run as 8 Ray actors (equal to one rank)
#     exact resume after a killed rank (tp2 pp2, dp2)
#   and prints a summary (versions, each test's result, wall time). Not part of .ci/run.
#
#   bash scripts/compat_check.sh                   # ~1 GB of wheels on the first run (pip's cache)
#   COMPAT_VENV=/path/to/venv PYTHON=python3.12 bash scripts/compat_check.sh
#   COMPAT_PINS="megatron-core==0.17.1 torch==2.14.1" bash scripts/compat_check.sh   # other versions
#
# Results go to docs/COMPATIBILITY.md by hand; the summary is also written to $COMPAT_VENV/summary.txt.
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
PYTHON=${PYTHON:-}
if [ -z "$PYTHON" ]; then
  PYTHON=$(command -v python3.12 || ls -d "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python 2>/dev/null | tail -1 || true)
fi
if [ -z "$PYTHON" ] || ! "$PYTHON" -c 'import sys; assert (3, 10) <= sys.version_info[:2] <= (3, 12)' 2>/dev/null; then
  echo "compat_check: no Python 3.10-3.12 interpreter (default: python3.12; set PYTHON=/path/to/python)" >&2
  exit 2
fi
VENV=${COMPAT_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/mcore_dpo/compat-venv312}
case "$(cd "$(dirname "$VENV")" 2>/dev/null && pwd || dirname "$VENV")/" in
  "$REPO"/*) echo "compat_check: COMPAT_VENV=$VENV is inside the repository; put it outside" >&2; exit 2 ;;
esac
PINS=${COMPAT_PINS:-}
LOG="$VENV.log"
start=$(date +%s)

# A machine-wide pip constraint file (PIP_CONSTRAINT or pip.conf) may cap torch at a locally
# mirrored release; this environment takes the registry as it is.
export PIP_CONSTRAINT=/dev/null
export PIP_DISABLE_PIP_VERSION_CHECK=1

echo "compat_check: building $VENV with $("$PYTHON" --version) (log: $LOG)"
rm -rf "$VENV"
mkdir -p "$(dirname "$VENV")"
"$PYTHON" -m venv "$VENV"
PY="$VENV/bin/python"
{
  # Newest releases first, then the project from setup.py: its ranges must accept them unchanged.
  # shellcheck disable=SC2086
  "$PY" -m pip install torch megatron-core transformers ray datasets safetensors $PINS
  "$PY" -m pip freeze | sort > "$VENV/freeze-before.txt"
  "$PY" -m pip install -e "$REPO[test]"
  "$PY" -m pip freeze | grep -v -i '^-e \|^mcore.dpo' | sort > "$VENV/freeze-after.txt"
} > "$LOG" 2>&1 || { tail -20 "$LOG"; echo "compat_check: install failed (see $LOG)" >&2; exit 1; }

changed=$(comm -23 "$VENV/freeze-before.txt" "$VENV/freeze-after.txt" | grep -i -E '^(torch|megatron-core|transformers|ray|datasets|safetensors)==' || true)
pip_check=$("$PY" -m pip check 2>&1) && pip_check_ok=1 || pip_check_ok=0
installed=$(date +%s)

export OMP_NUM_THREADS=1
export PYTHONPATH="$REPO"
TESTS=(
  scripts/compat_suite.py
  "tests/test_convert_cli.py::test_reshard_tp2pp2_to_tp1pp4_to_hf_is_identical"
  "tests/test_ray_launch.py::test_tp4_pp2_equals_tp1_pp1"
  "tests/test_resume.py::test_exact_resume_after_kill"
)
cd "$REPO"
set +e
nice -n "${COMPAT_NICE:-10}" "$PY" -m pytest -q -p no:cacheprovider --junitxml="$VENV/junit.xml" "${TESTS[@]}" \
  > "$VENV/pytest.txt" 2>&1
test_status=$?
set -e
end=$(date +%s)

{
  echo "== compat_check summary ($(date -u +%Y-%m-%dT%H:%MZ), $(uname -m), $(nproc) cores)"
  "$PY" - <<'EOF'
import platform
from importlib.metadata import version
print(f"python {platform.python_version()}")
for name in ("torch", "megatron-core", "transformers", "ray", "datasets", "safetensors", "numpy", "pytest"):
    print(f"{name} {version(name)}")
EOF
  if [ -z "$changed" ]; then echo "setup.py accepts these versions: yes (installing the project changed none of them)"
  else echo "setup.py accepts these versions: NO, installing the project replaced:"; echo "$changed"; fi
  if [ "$pip_check_ok" = 1 ]; then echo "pip check: $pip_check"; else echo "pip check: FAILED"; echo "$pip_check"; fi
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

if [ "$test_status" -ne 0 ] || [ -n "$changed" ] || [ "$pip_check_ok" != 1 ]; then
  echo "compat_check: FAILED (pytest output: $VENV/pytest.txt)" >&2
  exit 1
fi
echo "compat_check: passed"
