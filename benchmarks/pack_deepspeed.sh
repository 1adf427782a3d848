#!/usr/bin/env bash
# Adds DeepSpeed and the packages it needs to .device/wheels, after ../shared/gpu/pack.sh: the GPU image
# lacks them, and sequence parallelism (sp_size) runs on DeepSpeed. At this venv's versions, for the GPU
# machine's Python 3.12 (about 3 MB; DeepSpeed builds its CUDA ops there when a run first needs one).
#
#   bash ../shared/gpu/pack.sh && bash benchmarks/pack_deepspeed.sh
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
[ -d .device/wheels ] || { echo "no .device/wheels: run ../shared/gpu/pack.sh first" >&2; exit 2; }
version() { python -c "import importlib.metadata as m; print(m.version('$1'))"; }
pkgs=""
for p in hjson msgpack py-cpuinfo einops ninja; do pkgs="$pkgs $p==$(version "$p")"; done
plat=""; for n in 28 27 24 17; do plat="$plat --platform manylinux_2_${n}_x86_64"; done
# shellcheck disable=SC2086
python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $plat \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .device/wheels $pkgs
# DeepSpeed ships a source archive only: built here into a pure-Python wheel (no ops compiled).
python -m pip wheel -q --no-deps -w .device/wheels "deepspeed==$(version deepspeed)"
ls .device/wheels | grep -E -i 'deepspeed|hjson|msgpack|cpuinfo|einops|ninja'
