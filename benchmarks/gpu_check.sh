#!/usr/bin/env bash
# The GPU check in one command (under 8 minutes on one GPU): the `gpu`-marked tests, CUDA
# profiles of GPT-2 (124M), BERT-base and ResNet-50 at their recipe micro-batch in fp32 and
# bf16, and one training step of each next to the simulator's prediction for a 1-stage plan.
#
#   bash benchmarks/gpu_check.sh                  # on a machine with a CUDA device
#   bash benchmarks/gpu_check.sh --cpu            # the same steps on the CPU, tiny sizes
#   bash benchmarks/gpu_check.sh --fetch-wheels   # download pytest's wheels into $AUTOPIPE_WHEELS
#
# Everything goes under $OUT (default: a new temporary directory, printed at the start):
#   gpu_check.log   the whole console output          status.txt  one line per phase, exit codes
#   tests.log       pytest's output                   tests.json  per-test outcome and counts
#   env.json        python, torch, CUDA, device       steps.json / steps.md  measured vs predicted
#   profiles/<model>.<precision>.profile.json         the measured profiles, device named
# Interpreter: $PYTHON (default python3) with torch, Lightning and transformers (torchvision for
# ResNet-50); Hydra is not needed. When that interpreter has no pytest, the pure-Python wheels
# in $AUTOPIPE_WHEELS (default .whl/ in the repository) are unpacked into $OUT/pylib first.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
WHEELS="${AUTOPIPE_WHEELS:-$ROOT/.whl}"
MODE=gpu
case "${1:-}" in
  "") ;;
  --cpu) MODE=cpu ;;
  --fetch-wheels)
    mkdir -p "$WHEELS"
    # pure-Python wheels only (py3-none-any), usable by any interpreter from 3.10 on
    exec "$PYTHON" -m pip download --no-deps -d "$WHEELS" --only-binary=:all: \
      --platform any --implementation py --abi none --python-version 3.10 \
      pytest pluggy iniconfig packaging pygments exceptiongroup tomli pytest-timeout ;;
  -h|--help) sed -n '2,17p' "$0"; exit 0 ;;
  *) echo "unknown argument '$1'; use --cpu, --fetch-wheels or none (see --help)" >&2; exit 2 ;;
esac

OUT="${OUT:-$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
exec > >(tee -a "$OUT/gpu_check.log") 2>&1
TEE_PID=$!
export PYTHONUNBUFFERED=1
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
cd "$ROOT"
START=$SECONDS

echo "Reproduce: bash benchmarks/gpu_check.sh${1:+ $1}   (results in $OUT)"
echo "commit $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown), $(date -u +%FT%TZ)"

if [ "$MODE" = gpu ]; then
  if ! "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "no CUDA device visible to $PYTHON: run with --cpu for the CPU fallback" >&2
    echo "device: none (exit 2)" > "$OUT/status.txt"
    exit 2
  fi
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version \
    --format=csv,noheader
  PROFILE_ARGS=(--budget-s 200)
  TESTS_LIMIT=200 PROFILES_LIMIT=250
else
  PROFILE_ARGS=(--cpu --repeats 1 --steps 1 --warmup-steps 1)
  TESTS_LIMIT=200 PROFILES_LIMIT=300
fi

# ------------------------------------------------------------------------------------ 1. tests
if ! "$PYTHON" -c "import pytest" 2>/dev/null && ls "$WHEELS"/*.whl >/dev/null 2>&1; then
  echo "pytest missing: unpacking $(ls "$WHEELS"/*.whl | wc -l) wheels from $WHEELS"
  for wheel in "$WHEELS"/*.whl; do "$PYTHON" -m zipfile -e "$wheel" "$OUT/pylib"; done
  export PYTHONPATH="$OUT/pylib:$PYTHONPATH"
fi
if "$PYTHON" -c "import pytest" 2>/dev/null; then
  echo "== gpu tests (limit ${TESTS_LIMIT}s)"
  timeout -k 15 -s INT "$TESTS_LIMIT" "$PYTHON" -m pytest -m gpu tests/gpu -q -rA \
    -p no:cacheprovider --junitxml "$OUT/tests.xml" 2>&1 | tee "$OUT/tests.log"
  TESTS_RC=${PIPESTATUS[0]}
  "$PYTHON" - "$OUT/tests.xml" "$OUT/tests.json" <<'EOF'
import json, sys, xml.etree.ElementTree as ET
try:
    root = ET.parse(sys.argv[1]).getroot()
except (OSError, ET.ParseError) as exc:
    json.dump({"error": f"no junit report: {exc}"}, open(sys.argv[2], "w"), indent=1)
    raise SystemExit(0)
cases = []
for case in root.iter("testcase"):
    outcome = "passed"
    for tag in ("failure", "error", "skipped"):
        node = case.find(tag)
        if node is not None:
            outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
            message = (node.get("message") or "")[:300]
            break
    else:
        message = ""
    cases.append({"test": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome,
                  "seconds": float(case.get("time") or 0), "message": message})
counts = {k: sum(c["outcome"] == k for c in cases) for k in ("passed", "failed", "error",
                                                            "skipped")}
json.dump({"counts": counts, "cases": cases}, open(sys.argv[2], "w"), indent=1)
print("tests:", counts)
EOF
else
  echo "== gpu tests not run: no pytest for $PYTHON and no wheels in $WHEELS"
  TESTS_RC=127
fi
echo "tests: exit ${TESTS_RC} after $((SECONDS - START)) s" >> "$OUT/status.txt"

# --------------------------------------------------------------- 2. profiles and timed steps
echo "== profiles and one training step per model (limit ${PROFILES_LIMIT}s)"
timeout -k 15 -s INT "$PROFILES_LIMIT" "$PYTHON" benchmarks/gpu_profiles.py --out "$OUT" \
  "${PROFILE_ARGS[@]}"
PROFILES_RC=$?
echo "profiles: exit ${PROFILES_RC} after $((SECONDS - START)) s" >> "$OUT/status.txt"

cat "$OUT/status.txt"
echo "results in $OUT ($((SECONDS - START)) s)"
RC=0
[ "$TESTS_RC" -eq 0 ] && [ "$PROFILES_RC" -eq 0 ] || RC=1
exec >&- 2>&-
wait "$TEE_PID" 2>/dev/null  # the log is complete when the script returns
exit "$RC"
