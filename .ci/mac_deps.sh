#!/usr/bin/env bash
# A Mac install, resolved here: the project's dependencies (runtime; dev, eval, vision extras) must
# resolve for macOS 14 arm64 on every supported Python from wheels only (two pure-Python sdists
# allowed), at the newest versions and at the lowest the floors allow; and each runtime floor in
# pyproject.toml must itself be installable there (a floor with no wheel is a stale floor).
# A change that would make `pip install` fail or build from source on a Mac fails here.
# Uses uv from PATH, else installs it from PyPI into a throwaway venv. PYTHONS overrides the list.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHONS=${PYTHONS:-"3.11 3.12 3.13"}
PY=${PYTHON:-python3}
SDISTS=(sqlitedict word2number) # lm-eval's pure-Python dependencies that publish no wheel
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
UV=$(command -v uv || true)
if [ -z "$UV" ]; then
	"$PY" -m venv "$tmp/venv"
	"$tmp/venv/bin/python" -m pip install -q uv
	UV=$tmp/venv/bin/uv
fi
export MACOSX_DEPLOYMENT_TARGET=14.0 # mlx's wheels start at macosx_14_0_arm64
base=(--python-platform aarch64-apple-darwin --only-binary :all: --prerelease disallow
	--quiet --no-header --no-annotate)
extras=(--extra dev --extra eval --extra vision)
for sdist in "${SDISTS[@]}"; do extras+=(--no-binary "$sdist"); done

resolve() { # VERSION NAME ARGS...: compile into $tmp/NAME.txt or print why not and fail
	local version=$1 name=$2
	shift 2
	if ! "$UV" pip compile pyproject.toml "${base[@]}" --python-version "$version" "$@" \
		-o "$tmp/$name.txt" >"$tmp/log" 2>&1; then
		echo "mac_deps: no macOS arm64 install for Python $version ($name):"
		cat "$tmp/log"
		exit 1
	fi
}

for version in $PYTHONS; do
	resolve "$version" all-newest "${extras[@]}"
	resolve "$version" all-lowest "${extras[@]}" --resolution lowest-direct
	resolve "$version" runtime-floors --resolution lowest-direct
	"$PY" - "$tmp/runtime-floors.txt" "$version" <<'PYEOF'
import re, sys, tomllib

pinned = dict(
    line.strip().lower().split("==") for line in open(sys.argv[1]) if "==" in line
)
stale = []
for dep in tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]:
    m = re.match(r"([A-Za-z0-9_.-]+)(?:\[[^\]]*\])?\s*>=\s*([0-9.]+)", dep)
    if m and m[1].lower() in pinned:
        got, floor = pinned[m[1].lower()], m[2]
        if [int(x) for x in got.split(".")] > [int(x) for x in floor.split(".")] + [0] * (
            got.count(".") - floor.count(".")
        ):
            stale.append(f"{m[1]}>={floor} resolves to {got}")
if stale:
    sys.exit(f"mac_deps: Python {sys.argv[2]}: floors below what installs on macOS arm64: "
             + "; ".join(stale))
PYEOF
	echo "mac_deps: Python $version: newest, lowest and runtime floors resolve from wheels"
done
