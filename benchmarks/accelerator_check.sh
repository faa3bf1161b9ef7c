#!/usr/bin/env bash
# The accelerator check as one prepared command, for a GPU host lent for a few minutes: run from the repository
# root, results under $OUT (default runs/accelerator). The host's own Python (its JAX with the CUDA plugin, Flax,
# optax, chex, orbax) runs the checkout; resjax's other requirements come as wheels in .whl/ when the host has no
# package index: on the H200 image of 2026-12-04, ml-collections, mnist1d, grain, array-record, dm-tree, portpicker and
# importlib-resources (pip download --no-deps --only-binary=:all: --python-version 3.12 ... -d .whl NAME).
#
#   1. what the host is: the GPU (nvidia-smi), the Python packages, and whether this jaxlib knows resjax's
#      XLA:CPU flags (XLA aborts a process on a flag it does not know; if it does not, they are left out);
#   2. python -m benchmarks.accelerator (each section written to $OUT/accelerator.json as it finishes), at most
#      ACCELERATOR_S seconds (default 450: on an H200 on 2026-12-04, 330 s reached ResNet-110);
#   3. python -m experiments.reproduce --quick on the device from an empty compilation cache, at most QUICK_S
#      seconds (default 120; on that H200, 13 of the 20 experiments ran in 170 s): every experiment's code path on
#      the accelerator, as far as the limit allows.
set -u
out=${OUT:-runs/accelerator}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/resjax-site \
    .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/resjax-site
fi

echo "== the host"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv 2>&1
python3 -m pip list 2>/dev/null | grep -iE '^(jax|jaxlib|jax-cuda[0-9]+-(plugin|pjrt)|flax|optax|chex|orbax-checkpoint|numpy|ml.collections|grain|mnist1d) '
flags=$(python3 -c "import resjax; print(' '.join(resjax.CPU_XLA_FLAGS))")
if XLA_FLAGS="$flags" python3 -c "import jax, jax.numpy as jnp; jnp.ones(2, device=jax.devices('cpu')[0]).block_until_ready()" \
    >"$out/cpu_flags.log" 2>&1; then
  echo "this jaxlib knows resjax's XLA:CPU flags ($flags)"
else
  echo "this jaxlib does NOT know resjax's XLA:CPU flags ($flags): left out (RESJAX_XLA_CPU_FLAGS=0)"
  tail -3 "$out/cpu_flags.log"
  export RESJAX_XLA_CPU_FLAGS=0
fi

echo "== python -m benchmarks.accelerator"
export RESJAX_COMPILATION_CACHE=/tmp/resjax-cache-accelerator
start=$(date +%s)
timeout "${ACCELERATOR_S:-450}" python3 -m benchmarks.accelerator --out "$out/accelerator.json" 2>&1 \
  | tee "$out/accelerator.log" | grep -vE "^(WARNING|I0000|W0000)"
echo "(benchmarks.accelerator: exit ${PIPESTATUS[0]}, $(( $(date +%s) - start )) s)"

echo "== python -m experiments.reproduce --quick, empty compilation cache"
export RESJAX_COMPILATION_CACHE=/tmp/resjax-cache-quick
rm -rf /tmp/resjax-cache-quick /tmp/resjax-quick
start=$(date +%s)
timeout "${QUICK_S:-120}" python3 -m experiments.reproduce --quick --out /tmp/resjax-quick > "$out/quick.log" 2>&1
code=$?
echo "(reproduce --quick: exit $code, $(( $(date +%s) - start )) s)"
grep -E "running|took|wrote|Error|error:" "$out/quick.log" | tail -30
[ -f /tmp/resjax-quick/REPORT.md ] && cp /tmp/resjax-quick/REPORT.md "$out/REPORT-quick.md"
exit 0
