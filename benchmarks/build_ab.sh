#!/usr/bin/env bash
# `dflash build` of one recipe by two versions of the code, alternating, a fresh cache each time:
# "new" = this checkout, "old" = git revision OLD_REV (a temporary worktree, run with this venv).
# VARIANTS (default "new old") may add environment settings to a version, e.g.
# VARIANTS="new old old:DFLASH_EXPORT_WORKERS=0" (the old code without its forked tracers).
# Prints per build: variant, wall s, max RSS KiB (/usr/bin/time), then each stage's seconds.
#
#   bash benchmarks/build_ab.sh OLD_REV [RECIPE] [ROUNDS]
#   (RECIPE defaults to the recipe benchmarks/genai_builder_compare.sh writes for the 0.6B-shaped pair)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$PWD
OLD_REV=$1
RECIPE=$(realpath "${2:-/work/genai-compare/recipe.yaml}")
ROUNDS=${3:-4}
VARIANTS=${VARIANTS:-new old}
WORK=$(mktemp -d)
trap 'git -C "$ROOT" worktree remove --force "$WORK/old" >/dev/null 2>&1 || true; rm -rf "$WORK"' EXIT
git worktree add -q "$WORK/old" "$OLD_REV"
cd "$WORK"  # not the checkout: `python -m` would put it ahead of PYTHONPATH
for _ in $(seq 1 "$ROUNDS"); do
  for variant in $VARIANTS; do
    version=${variant%%:*}
    settings=()
    [ "$variant" != "$version" ] && IFS=, read -ra settings <<< "${variant#*:}"
    code=$ROOT
    [ "$version" = old ] && code=$WORK/old
    rm -rf "$WORK/cache"
    env "${settings[@]}" PYTHONPATH="$code" /usr/bin/time -f "%e %M" -o "$WORK/time" "$ROOT/.venv/bin/python" \
      -m dflash_cli build --recipe "$RECIPE" --cache-dir "$WORK/cache" --json > "$WORK/build.json" 2> /dev/null
    echo "$variant $(cat "$WORK/time") $(python3 -c "import json,sys; print(*[s['seconds'] for s in json.load(open(sys.argv[1]))['stages']])" "$WORK/build.json")"
  done
done
