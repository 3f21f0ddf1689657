#!/usr/bin/env bash
# Build everything the GPU machine needs, here (DESIGN §6 step 1-2). Run from anywhere:
#
#     bash scripts/build_wheel.sh
#
# 1. the abi3 wheel:  maturin build --release -o dist  (checks: abi3 tag usable by CPython 3.12,
#    manylinux glibc tag <= $MAX_GLIBC, default 2.35, the GPU machine's floor)
# 2. dist/COMMIT: git rev-parse HEAD (+ "-dirty"), read by gpu_check.sh (the GPU machine has no .git)
# 3. .whl/: extra wheels the GPU machine lacks (nvidia-cuda-crt==13.0.88 and nbclient + ipykernel
#    with their dependencies for the notebooks stage; cp312 manylinux x86_64)
# 4. .assets/minilm: the fp16 all-MiniLM-L6-v2 copy for the demo (scripts/make_demo_assets.py)
# 5. prints the size of what travels (limit 64 MiB) and the device command + carry list.
#
# dist/, .whl/ and .assets/ are git-ignored. Env: PYTHON (default /work/venv/bin/python if it
# exists, else python3), MATURIN (default: maturin next to PYTHON, else on PATH), MAX_GLIBC,
# SKIP_WHEEL=1 (reuse dist/), EXTRA_WHEELS (default "nvidia-cuda-crt==13.0.88" + the notebook
# runner's wheels, NOTEBOOK_WHEELS below).
set -euo pipefail
cd "$(dirname "$(readlink -f "$0")")/.."

if [ -z "${PYTHON:-}" ]; then
    if [ -x /work/venv/bin/python ]; then PYTHON=/work/venv/bin/python; else PYTHON=python3; fi
fi
if [ -z "${MATURIN:-}" ]; then
    MATURIN="$(dirname "$PYTHON")/maturin"; [ -x "$MATURIN" ] || MATURIN=maturin
fi
MAX_GLIBC=${MAX_GLIBC:-2.35}
# nvidia-cuda-crt: NVRTC's crt/mma.h. The rest: what scripts/run_notebooks.py (nbclient + an
# ipykernel kernel) needs and the GPU machine's image lacks (it has matplotlib, attrs, packaging,
# psutil, pygments, python-dateutil, typing-extensions, tqdm). Not debugpy (5 MB; ipykernel
# imports it only for the debugger, and a kernel starts without it).
NOTEBOOK_WHEELS="nbclient==0.11.0 nbformat==5.11.1 jupyter_client==8.10.0 jupyter_core==5.9.1
    ipykernel==7.4.0 ipython==9.18.1 ipython_pygments_lexers==1.1.1 traitlets==5.16.1 pyzmq==27.3.0
    tornado==6.6.1 comm==0.2.3 jedi==0.20.1 parso==0.8.7 prompt_toolkit==3.0.53 wcwidth==0.9.4
    stack_data==0.6.3 executing==2.3.0 asttokens==3.0.2 pure_eval==0.2.4 pexpect==4.9.0
    ptyprocess==0.7.0 matplotlib_inline==0.2.2 nest_asyncio2==1.7.4 platformdirs==4.14.8
    fastjsonschema==2.22.3 jsonschema==4.26.0 jsonschema_specifications==2025.9.1
    referencing==0.37.0 rpds_py==2026.9.1"
EXTRA_WHEELS=${EXTRA_WHEELS:-"nvidia-cuda-crt==13.0.88 $NOTEBOOK_WHEELS"}

# ---- 1. wheel ---------------------------------------------------------------------------------
mkdir -p dist
if [ "${SKIP_WHEEL:-0}" != 1 ]; then
    rm -f dist/ferroattn-*.whl
    echo "== maturin build --release -o dist"
    "$MATURIN" build --release -o dist
fi
mapfile -t wheels < <(ls dist/ferroattn-*.whl 2>/dev/null)
if [ "${#wheels[@]}" -ne 1 ]; then echo "expected exactly one dist/ferroattn-*.whl, found ${#wheels[@]}" >&2; exit 1; fi
whl=${wheels[0]}
name=$(basename "$whl")
echo "wheel: $name ($(du -h "$whl" | cut -f1))"
# tags: ferroattn-VER-cp3XX-abi3-manylinux_2_YY_x86_64[.manylinux...].whl
"$PYTHON" - "$name" "$MAX_GLIBC" <<'EOF'
import re, sys
name, max_glibc = sys.argv[1], tuple(int(x) for x in sys.argv[2].split("."))
parts = name[:-4].split("-")
py, abi, plat = parts[-3], parts[-2], parts[-1]
problems = []
m = re.fullmatch(r"cp3(\d+)", py)
if abi != "abi3" or not m or int(m.group(1)) > 12:
    problems.append(f"python tag {py}-{abi}: expected cp3N-abi3 with N <= 12 (the GPU machine runs CPython 3.12)")
for p in plat.split("."):
    if "x86_64" not in p:
        problems.append(f"platform {p}: expected x86_64")
    g = re.fullmatch(r"manylinux_(\d+)_(\d+)_x86_64", p)
    if g and (int(g.group(1)), int(g.group(2))) > max_glibc:
        problems.append(f"platform {p}: needs glibc newer than {sys.argv[2]}")
    if p.startswith("linux_"):
        problems.append(f"platform {p}: not a manylinux tag (pip on the GPU machine would refuse it)")
if problems:
    sys.exit("wheel tag check failed: " + "; ".join(problems))
print(f"tags ok: {py}-{abi}-{plat} (glibc <= {sys.argv[2]})")
EOF

# ---- 2. commit --------------------------------------------------------------------------------
commit=$(git rev-parse HEAD 2>/dev/null || echo "uncommitted")
if [ -n "$(git status --porcelain 2>/dev/null | head -n1)" ]; then commit="$commit-dirty"; fi
echo "$commit" > dist/COMMIT
echo "commit: $commit"

# ---- 3. extra wheels --------------------------------------------------------------------------
mkdir -p .whl
for spec in $EXTRA_WHEELS; do
    pkg=${spec%%==*}; ver=${spec##*==}
    if ls .whl/"${pkg//-/_}"-"$ver"-*.whl >/dev/null 2>&1; then echo "have $spec"; continue; fi
    "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "$spec"
done
ls -l .whl

# ---- 4. demo assets ---------------------------------------------------------------------------
"$PYTHON" scripts/make_demo_assets.py --out .assets/minilm

# ---- 5. sizes and the command -----------------------------------------------------------------
tree_bytes=$(git ls-files -z -c -o --exclude-standard | xargs -0 -r stat -c %s 2>/dev/null | awk '{s+=$1} END {print s+0}')
carry_bytes=$(du -sb dist .whl .assets | awk '{s+=$1} END {print s+0}')
total=$(( tree_bytes + carry_bytes ))
printf 'travels: working tree %.1f MiB + carried dist,.whl,.assets %.1f MiB = %.1f MiB (limit 64 MiB)\n' \
    "$(echo "$tree_bytes / 1048576" | bc -l)" "$(echo "$carry_bytes / 1048576" | bc -l)" "$(echo "$total / 1048576" | bc -l)"
if [ "$total" -gt $(( 64 * 1048576 )) ]; then echo "too large to travel" >&2; exit 1; fi
cat <<'EOF'
device call:  command "bash scripts/gpu_check.sh"   carry ["dist", ".whl", ".assets"]   timeout_s 600
EOF
