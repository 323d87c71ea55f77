#!/usr/bin/env bash
# Same-host A/B of plan times: plan_time.py of an older commit's wheels and of the checkout,
# alternating twice (H200 hosts differ by up to 2x in Python speed, and one host drifts between
# runs: compare only numbers from one such run).
#
# On this machine, before ../shared/device/prepare.sh:
#   git worktree add /tmp/wt-old <commit>
#   for d in core plugins/cudnn plugins/cuda_native; do
#     python -m pip wheel -q --no-deps --no-build-isolation -w .gpu/old /tmp/wt-old/$d; done
#   git worktree remove --force /tmp/wt-old
# On the GPU machine (after `source .gpu/env.sh`; AB_BACKENDS defaults to cudnn,cuda_native):
#   AB_BACKENDS=cudnn AB_ROUNDS=5 bash benchmarks/plan_time_ab.sh      # writes $OUT/r/ab.txt
# run_time.py adds eager run() host times (AB_RUN_BACKENDS, default cudnn,cuda_native,trtllm,torch).
# AB_ROUNDS (default 2): old/new alternations; AB_PLANS (default 200): plans per row. Hosts drift within a run too: take the median of
# each side over the rounds.
# Run it on a settled machine: right after the GPU tests, plan times are disturbed.
set -uo pipefail
mkdir -p "$OUT/r"
export TACTIX_CACHE_DIR=${TACTIX_CACHE_DIR:-/tmp/txcache}
if [ ! -f /tmp/old-site/.ok ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/old-site .gpu/deps/*.whl .gpu/project/*.whl
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/old-site .gpu/old/*.whl
  # the same flashinfer tree as the new side's (importing it, as the trtllm plugin's environment
  # check does, changes torch's per-call cost: both sides must have it or neither)
  [ -f .gpu/flashinfer-trim.tar.xz ] && tar -xJf .gpu/flashinfer-trim.tar.xz -C /tmp/old-site
  touch /tmp/old-site/.ok
fi
NEW=$PYTHONPATH
PLAN_BACKENDS=${AB_BACKENDS:-cudnn,cuda_native}
RUN_BACKENDS=${AB_RUN_BACKENDS:-cudnn,cuda_native,trtllm,torch}
RUN_LINES=$((1 + $(echo "$RUN_BACKENDS" | tr ',' '\n' | wc -l)))  # the header and one row per backend
for round in $(seq "${AB_ROUNDS:-2}"); do
  for which in old new; do
    if [ "$which" = old ]; then export PYTHONPATH=/tmp/old-site; else export PYTHONPATH=$NEW; fi
    echo "== $which (round $round, $(date +%T)): $(python3 -c 'import tactix; print(tactix.__file__)')"
    (cd benchmarks && python3 plan_floor.py | head -1 \
      && python3 plan_time.py --backends "$PLAN_BACKENDS" --plans "${AB_PLANS:-200}" | grep -E " plan | not implemented" \
      && python3 run_time.py --backends "$RUN_BACKENDS" | tail -n "$RUN_LINES")
  done
done 2>&1 | tee "$OUT/r/ab.txt"
export PYTHONPATH=$NEW
