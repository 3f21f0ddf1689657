#!/usr/bin/env bash
# Prepare .fa2suite/ (git-ignored) in the repository root for the `fa2` stage of
# scripts/gpu_check.sh: flash-attention's own test suite run against ferroattn. Run it on the
# development machine; the GPU machine gets only the checkout, so carry .fa2suite there.
#
#     scripts/fa2suite.sh FA2_GIT_DIR          (or FA2_GIT_DIR=... scripts/fa2suite.sh)
#
# FA2_GIT_DIR: a git directory (bare or a .git) of a clone of Dao-AILab/flash-attention that has
#   commit 0251105a; the suite's test file is tests/test_flash_attn.py of that commit, taken with
#   `git show` (no network access here).
# FA2SUITE_SRC: the runner folder to copy (run.sh, conftest.py, summarize.py, the flash_attn alias
#   package; default /work/shared/fa2suite).
#
# Result: .fa2suite/{run.sh,conftest.py,summarize.py,flash_attn/,test_flash_attn.py}. The test file
# is flash-attention's code: it stays in the ignored folder and is never committed.
set -euo pipefail

COMMIT=0251105a
ROOT=$(cd "$(dirname "$(readlink -f "$0")")/.." && pwd)
DEST="$ROOT/.fa2suite"
SRC=${FA2SUITE_SRC:-/work/shared/fa2suite}
GIT_DIR_ARG=${1:-${FA2_GIT_DIR:-}}

die() { echo "fa2suite.sh: $*" >&2; exit 2; }

[ -n "$GIT_DIR_ARG" ] || die "no flash-attention git directory: pass it as the first argument or set FA2_GIT_DIR
  (a clone of github.com/Dao-AILab/flash-attention with commit $COMMIT)"
[ -d "$GIT_DIR_ARG" ] || die "FA2_GIT_DIR=$GIT_DIR_ARG: not a directory"
git --git-dir "$GIT_DIR_ARG" cat-file -e "$COMMIT^{commit}" 2>/dev/null || \
    die "FA2_GIT_DIR=$GIT_DIR_ARG: not a git directory with commit $COMMIT of flash-attention"
git --git-dir "$GIT_DIR_ARG" cat-file -e "$COMMIT:tests/test_flash_attn.py" 2>/dev/null || \
    die "FA2_GIT_DIR=$GIT_DIR_ARG: commit $COMMIT has no tests/test_flash_attn.py"
for f in run.sh conftest.py summarize.py flash_attn/__init__.py; do
    [ -f "$SRC/$f" ] || die "FA2SUITE_SRC=$SRC: $f missing (expected the fa2suite runner folder)"
done

rm -rf "$DEST"
mkdir -p "$DEST"
# the runner as it is (without caches); the source may be read-only, the copy is made writable
tar -C "$SRC" --exclude=__pycache__ --exclude='*.pyc' --exclude=test_flash_attn.py -cf - . | tar -C "$DEST" -xf -
chmod -R u+w "$DEST"
git --git-dir "$GIT_DIR_ARG" show "$COMMIT:tests/test_flash_attn.py" > "$DEST/test_flash_attn.py"
[ -s "$DEST/test_flash_attn.py" ] || die "empty tests/test_flash_attn.py from $COMMIT"

echo "fa2suite.sh: $DEST ready: runner from $SRC, test_flash_attn.py of flash-attention $COMMIT" \
     "($(wc -l < "$DEST/test_flash_attn.py") lines, sha256 $(sha256sum "$DEST/test_flash_attn.py" | cut -c1-16))"
echo "fa2suite.sh: carry .fa2suite to the GPU machine and run: GPU_CHECK_STAGES=precompile,fa2 bash scripts/gpu_check.sh"
