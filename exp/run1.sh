#!/usr/bin/env bash
set -uo pipefail
export PYTHONUNBUFFERED=1
R=$PWD
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > $OUT/gpu.txt
t0=$(date +%s)
MLA_KV_CUDA_ARCHS=90 CMAKE_BUILD_PARALLEL_LEVEL=16 python3 -m pip install --no-build-isolation --no-deps -v . > $OUT/build.log 2>&1 || { tail -40 $OUT/build.log; exit 1; }
echo "build $(( $(date +%s) - t0 )) s"
cd /tmp
for cfg in "" "MLA_KV_SM90_NARROW=0" "MLA_KV_SM90_CP_ASYNC=1"; do
  n=${cfg:-default}
  echo "== tests $n"
  env $cfg MLA_KV_REQUIRE_GPU=1 timeout 150 python3 -m pytest -q -x -m gpu --rootdir $R $R/tests/test_attention.py -p no:cacheprovider > $OUT/tests_${n}.log 2>&1; echo "rc $?"; tail -4 $OUT/tests_${n}.log
done
for cfg in "" "MLA_KV_SM90_NARROW=0" "MLA_KV_SM90_CP_ASYNC=1" "MLA_KV_SM90_NARROW=0 MLA_KV_SM90_CP_ASYNC=1"; do
  echo "== times ${cfg:-default}"
  env $cfg timeout 100 python3 $R/bench/profile_decode.py --times 2>&1 | tail -8
done
