#!/usr/bin/env bash
# The H200 checks of an issue, as named jobs run side by side within one device call.
#
#   ../shared/device/prepare.sh --flashinfer          # here, after every code change
#   run: source .gpu/env.sh && bash benchmarks/h200_checks.sh JOB [JOB ...]
#
# Each job runs under `timeout` (H200_LIMIT seconds, default 550: the device tool stops a call at
# 600) and writes its log to /tmp/h200-logs; JSON results go to $OUT. The call returns at most 8
# files: per call name at most 6 JSON-writing jobs (the summary and the logs' tarball are the
# other two). Jobs (what they cost on the H200 of session 12, when run beside three others):
#   warm-fmha            compile trtllm's four FMHAv2 modules (minutes each; one took >6 min beside
#                        six other jobs): run it first, alone or beside light jobs, then run the
#                        trtllm prefill jobs in the next call while the machine is still warm
#   warm-flashinfer      FlashInfer's anchor modules for the bench (fa2/tc decode, fa2/fa3 prefill,
#                        bf16 and e4m3 KV): 15-90 s each
#   kit-torch kit-cudnn kit-cuda_native kit-trtllm-decode kit-trtllm-prefill
#                        tactix conformance (2-7 min each; KIT_K: a pytest -k expression for a subset)
#   gpu-rest gpu-cuda_native gpu-trtllm
#                        tests/gpu by file group (3, 6 and 5 min; GPU_K: a -k expression)
#   fp8-cvt              the bench's cuda_native fp8 rows (and P1's 16-bit one) with TACTIX_CUDA_NATIVE_FP8_CVT=1
#                        (the hardware conversion) and 2 (the integer placement), one after the other (run
#                        it alone; FP8_CVT_CASES picks other cases)
#   fp8-prefill-probe    benchmarks/fp8_prefill_probe.py: the wgmma prefill over fp8 and 16-bit caches on P1
#   cudnn-sinks-probe    benchmarks/cudnn_sinks_probe.py: does cuDNN's paged SDPA take sink_token (prefill, decode)?
#   ragged-tma-probe     benchmarks/ragged_tma_probe.py: R1-R3 on cuda_native, K/V through tensor maps against the
#                        one-token-page gather, a few tactics, alternating twice (about 60 s on a fresh H100)
#   sections-probe       the same probe alternating TACTIX_CUDA_NATIVE_HEAD_SECTIONS (1: head sections, 0: heads fastest)
#                        on the default tactic (SECTIONS_TACTICS: other probe tactics too, e.g. "default,128 s2 pp
#                        persist sched2,128 s2 pp persist sched3" also times sched 3's turns from a counter):
#                        R2 is the case sections change (sessions 38-39: written, not yet run)
#   ncu-ragged           Nsight Compute over benchmarks/ragged_ncu.py (NCU_CASE, default R1; NCU_TACTICS, default
#                        persist2,persist3, beside the default tactic; NCU_FA3=1 adds fa3, whose JIT build takes
#                        minutes on a fresh machine): one launch each, speed of light, launch, occupancy,
#                        scheduler, warp state and instruction sections; run it alone (ncu serializes kernels)
#   ncu-source           Nsight Compute's per-SASS-instruction counts (SourceCounters) of cuda_native's default ragged
#                        tactic (NCU_TACTICS: more) on NCU_CASE (default R1), as CSV (`--page source --print-source
#                        sass`) beside the report: which instructions of the kernel run how often
#   kernel-ab            benchmarks/kernel_ab.py: the ragged prefill kernels of .gpu/old's wheels against the checkout's
#                        (ragged_tma_probe.py in each, new old new old, outputs checked against the float64 oracle;
#                        KAB_CASES, default R1,R2,R3; KAB_TACTICS, default "default,128 s2 pp persist sched2")
#   ragged-host          benchmarks/ragged_host.py: ragged run() host time, same and new K/V each call (R1, R3)
#   bench-attention      tactix bench on the attention cases (bf16, fp8, V1), FlashInfer anchors
#   bench-open-models    tactix bench on R1-R3 (ragged, DeepSeek 192/128) and O1 (gpt-oss sinks), anchors
#   plan-device          plan_time.py for cuda_native with decode work lists made on the device and on the host
#                        (TACTIX_CUDA_NATIVE_HOST_PLAN=1), alternating twice
#   plan-profile         benchmarks/plan_breakdown.py --profile: where decode plan() spends its host time
#                        (PROFILE_BACKENDS, default cuda_native,trtllm; host and device page indices, b8 and b64)
#   plan-timers          the same with plan_breakdown.py's timers (inclusive us per plan of each function) instead
#   gather-probe         benchmarks/gather_probe.py: Staging.gather's driver-launched page-table kernel against
#                        the torch path it replaces (host us, same table, device us)
#   demo                 tactix demo (a Llama-like prefill and 3 decode steps, eager against CUDA-graph times)
#   tp-step              examples/tensor_parallel_step.py under torchrun (TP_RANKS, default 2: nvidia-h200-x2)
#   gpu-nccl             tests/gpu/test_distributed_nccl.py: rank-consistent tuning and failures over NCCL (2 GPUs)
#   eager-suite          the whole suite in eager mode, in three parts one after the other (decode and sinks;
#                        prefill and ragged with trtllm disabled: FMHAv2 compiles for >9 min on a fresh
#                        machine; GEMM), each under EAGER_LIMITS (default 250,170,150 s), no FlashInfer rows,
#                        one settle block: a stopped part still reports the cases it finished
#   bench-eager          tactix bench --execution eager (EAGER_CASES: some case ids; EAGER_ARGS: more options,
#                        e.g. --no-tune): rows ranked by eager cost, auto (untuned) against the best; its
#                        JSON rebuilds the untuned order table (tactix untuned-order build)
#   ab                   benchmarks/host_ab.py: plan() and run() host times of an older commit's
#                        wheels (.gpu/old) and of the checkout, interleaved (run it alone; AB_ROUNDS,
#                        AB_BACKENDS, AB_RUN_BACKENDS: trtllm's first use compiles its modules for
#                        minutes on a fresh machine, so leave it out of a short call). Make
#                        .gpu/old here before prepare.sh (which keeps it):
#                          git worktree add /tmp/wt-old <commit>
#                          for d in core plugins/cudnn plugins/cuda_native plugins/trtllm; do
#                            python -m pip wheel -q --no-deps --no-build-isolation -w .gpu/old /tmp/wt-old/$d; done
#                          git worktree remove --force /tmp/wt-old
#                        AB_CONTROL=1 adds a third worker of the old wheels (an A/A: the harness's bias)
#                        AB_SKIP: --skip patterns ('plan/trtllm/prefill*'). trtllm's prefill rows refuse to
#                        run until FMHAv2 is compiled (session 24 lost two runs to its minutes of nvcc on a
#                        fresh machine): add 'python -m tactix warmup trtllm' first, or skip them
#                        FlashInfer's reference rows JIT-compile too: on session 25's fresh H100 the first
#                        round spent ~300 s compiling (trtllm's XQA 30 s, fa2 batch prefill ~230 s, fa2 decode): skip
#                        'plan/flashinfer/prefill*' in a short call, or give the first round the whole limit
#   layers               benchmarks/run_layers.py on the checkout and on .gpu/old, alternating twice:
#                        where an eager decode run() spends its host time (core, plugin, cuDNN)
#   parity               benchmarks/flashinfer_parity/run.py on a seeded sample (PARITY_SAMPLE, default 60)
#                        with tactix's wrappers substituted, in PARITY_WORKERS (8) xdist processes: a cold
#                        machine spends most of it compiling FlashInfer's reference modules (session 18:
#                        24 of 80 cases in 540 s in one process)
#   parity-reference     the same sample with FlashInfer's own wrappers (run it beside parity: they share
#                        FlashInfer's compiled reference modules, whose build takes a file lock)
# Nothing here is a result until its JSON or log is committed under benchmarks/results/.
set -uo pipefail
LOGS=/tmp/h200-logs
mkdir -p "$LOGS" "$OUT"
export TACTIX_CACHE_DIR=${TACTIX_CACHE_DIR:-/tmp/txcache}
LIMIT=${H200_LIMIT:-550}
ATTENTION=D1,D2,D3,D1-fp8,D2-fp8,D3-fp8,P1,P1-fp8,P3,P3-fp8,V1
OPEN_MODELS=${OPEN_MODELS:-R1,R2,R3,O1,O1-w128}  # issue 24: DeepSeek ragged prefill, a ragged chunk, gpt-oss decode with sinks

t() { timeout -s INT -k 30 "$LIMIT" "$@"; }  # SIGINT: pytest still writes the kit's JSON (KILL 30 s later)

# the old side of the A/B: the same dependencies and flashinfer tree as the new side (importing
# flashinfer, as the trtllm plugin's environment check does, changes torch's per-call cost: both
# sides must have it or neither), tactix's packages from .gpu/old
old_site() {
  [ -f /tmp/old-site/.ok ] && return 0
  ls .gpu/old/*.whl > /dev/null || { echo "ab: no wheels in .gpu/old (see the top of this script)"; return 2; }
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/old-site .gpu/deps/*.whl .gpu/project/*.whl \
    && python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/old-site .gpu/old/*.whl \
    && { [ ! -f .gpu/flashinfer-trim.tar.xz ] || tar -xJf .gpu/flashinfer-trim.tar.xz -C /tmp/old-site; } \
    && touch /tmp/old-site/.ok
}

job() {
  case "$1" in
    warm-fmha) TACTIX_TRTLLM_WARMUP="ops=prefill" t python -m tactix warmup trtllm ;;
    warm-flashinfer) t python -m tactix bench --cases D2,D2-fp8,P3,P3-fp8,V1 --backends torch --no-tune --repeat 3 ;;
    kit-torch | kit-cudnn | kit-cuda_native)
      t python -m tactix conformance "${1#kit-}" ${KIT_K:+-k "$KIT_K"} --json "$OUT/conformance-${1#kit-}-h200.json" ;;
    kit-trtllm-decode) t python -m tactix conformance trtllm -k "not prefill${KIT_K:+ and ($KIT_K)}" \
      --json "$OUT/conformance-trtllm-decode-h200.json" ;;
    kit-trtllm-prefill) t python -m tactix conformance trtllm -k "prefill${KIT_K:+ and ($KIT_K)}" \
      --json "$OUT/conformance-trtllm-prefill-h200.json" ;;
    gpu-rest) t python -m pytest -q -p no:cacheprovider --durations=10 ${GPU_K:+-k "$GPU_K"} tests/gpu/test_autotune_cuda.py tests/gpu/test_staging_gpu.py \
      tests/gpu/test_cudnn_gpu.py tests/gpu/test_torch_backend_cuda.py ;;
    gpu-cuda_native) t python -m pytest -q -p no:cacheprovider --durations=10 ${GPU_K:+-k "$GPU_K"} tests/gpu/test_cuda_native_gpu.py ;;
    gpu-trtllm) t python -m pytest -q -p no:cacheprovider --durations=10 ${GPU_K:+-k "$GPU_K"} tests/gpu/test_trtllm_gpu.py ;;
    fp8-cvt)
      for mode in 1 2; do  # the hardware conversion against the integer placement (kernels/fp8.cuh)
        TACTIX_CUDA_NATIVE_FP8_CVT=$mode t python -m tactix bench --cases "${FP8_CVT_CASES:-D1-fp8,D2-fp8,D3-fp8,P1,P1-fp8}" \
          --backends cuda_native --no-tune --no-flashinfer --json "$OUT/bench-fp8-cvt$mode.json" || return 1
      done ;;
    fp8-prefill-probe) t python benchmarks/fp8_prefill_probe.py --json "$OUT/fp8-prefill-probe-h200.json" ;;
    cudnn-sinks-probe) t python benchmarks/cudnn_sinks_probe.py --json "$OUT/cudnn-sinks-probe-h200.json" ;;
    ragged-tma-probe) t python benchmarks/ragged_tma_probe.py --json "$OUT/ragged-tma-probe.json" ;;
    sections-probe) t python benchmarks/ragged_tma_probe.py --toggle TACTIX_CUDA_NATIVE_HEAD_SECTIONS --tactics "${SECTIONS_TACTICS:-default}" \
      --json "$OUT/sections-probe.json" ;;
    ncu-ragged) t ncu --profile-from-start off --clock-control none --section SpeedOfLight --section LaunchStats \
      --section Occupancy --section SchedulerStats --section WarpStateStats --section InstructionStats \
      python benchmarks/ragged_ncu.py --case "${NCU_CASE:-R1}" --tactics "${NCU_TACTICS:-persist2,persist3}" \
      $([ "${NCU_FA3:-0}" = 1 ] || echo --no-flashinfer) > "$OUT/ncu-${NCU_CASE:-R1}.txt" 2>&1 ;;
    ncu-source) t ncu --profile-from-start off --clock-control none --section SourceCounters --section InstructionStats \
      -f -o /tmp/ncu-source python benchmarks/ragged_ncu.py --case "${NCU_CASE:-R1}" --tactics "${NCU_TACTICS-}" --no-flashinfer \
      && cp /tmp/ncu-source.ncu-rep "$OUT/" \
      && ncu -i /tmp/ncu-source.ncu-rep --page source --print-source sass --csv > "$OUT/ncu-source-${NCU_CASE:-R1}.csv" ;;
    kernel-ab) old_site && t python3 benchmarks/kernel_ab.py --old /tmp/old-site --new "$PYTHONPATH" --cases "${KAB_CASES:-R1,R2,R3}" \
      --tactics "${KAB_TACTICS:-default,128 s2 pp persist sched2}" --json "$OUT/kernel-ab.json" ;;
    ragged-host) t python benchmarks/ragged_host.py --json "$OUT/ragged-host.json" ;;
    bench-attention) t python -m tactix bench --cases "$ATTENTION" --json "$OUT/bench-attention-h200.json" \
      --markdown "$OUT/bench-attention-h200.md" ;;
    bench-open-models) t python -m tactix bench --cases "$OPEN_MODELS" --json "$OUT/bench-open-models-h200.json" \
      --markdown "$OUT/bench-open-models-h200.md" ;;
    plan-device) for side in device host device host; do  # cuda_native decode plans: work list on the device or the host
        TACTIX_CUDA_NATIVE_HOST_PLAN=$([ $side = host ] && echo 1 || echo 0) t python benchmarks/plan_time.py \
          --backends cuda_native --json "/tmp/plan-$side-$RANDOM.json" || return 1
      done && python3 -c "import glob, json, sys; json.dump({f: json.load(open(f)) for f in sorted(glob.glob('/tmp/plan-*.json'))}, open(sys.argv[1], 'w'), indent=1)" "$OUT/plan-device-host-h200.json" ;;
    plan-profile | plan-timers) for b in $(echo "${PROFILE_BACKENDS:-cuda_native,trtllm}" | tr , ' '); do
        for where in host device; do
          (cd benchmarks && t python plan_breakdown.py --backend "$b" --indices "$where" --plans 400 \
            $([ "$1" = plan-profile ] && echo --profile)) || return 1
        done
      done ;;
    demo) t python -m tactix demo --json "$OUT/demo-h200.json" ;;
    gather-probe) for b in 8 64; do t python benchmarks/gather_probe.py --batch $b --json "$OUT/gather-probe-b$b.json"; done ;;
    tp-step) t python -m torch.distributed.run --standalone --nproc-per-node "${TP_RANKS:-2}" \
      examples/tensor_parallel_step.py --json "$OUT/tp-step-h200.json" ;;
    gpu-nccl) t python -m pytest -q -p no:cacheprovider --durations=10 tests/gpu/test_distributed_nccl.py ;;
    eager-suite) IFS=, read -r l1 l2 l3 <<< "${EAGER_LIMITS:-250,170,150}"
      common="--execution eager --no-flashinfer --settle-blocks 1 --warmup-ms 20"
      LIMIT=$l1 t python -m tactix bench $common --cases D1,D2,D3,D1-fp8,D2-fp8,D3-fp8,V1,O1,O1-w128 \
        --json "$OUT/eager-decode.json" --markdown "$OUT/eager-decode.md"
      TACTIX_DISABLE_BACKENDS=trtllm LIMIT=$l2 t python -m tactix bench $common --cases P1,P2,P3,P4,P1-fp8,P3-fp8,R1,R2,R3 \
        --json "$OUT/eager-prefill.json" --markdown "$OUT/eager-prefill.md"
      LIMIT=$l3 t python -m tactix bench $common --cases G1,G2-m1,G2-m16,G2-m64,G2-m256,G3-n14336,G3-k14336,G4 \
        --json "$OUT/eager-gemm.json" --markdown "$OUT/eager-gemm.md" ;;
    bench-eager) t python -m tactix bench --execution eager ${EAGER_CASES:+--cases "$EAGER_CASES"} ${EAGER_ARGS:-} \
      --json "$OUT/bench-eager-h200.json" --markdown "$OUT/bench-eager-h200.md" ;;
    ab) old_site && t python3 benchmarks/host_ab.py --old /tmp/old-site --new "$PYTHONPATH" \
      --rounds "${AB_ROUNDS:-20}" --budget-s $((LIMIT - 60)) ${AB_CONTROL:+--control} --backends "${AB_BACKENDS:-cudnn,cuda_native,trtllm}" \
      --run-backends "${AB_RUN_BACKENDS:-cudnn,cuda_native,trtllm,torch}" ${AB_SKIP:+--skip "$AB_SKIP"} --json "$OUT/host-ab-h200.json" ;;
    layers) old_site && for side in new old new old; do
        if [ $side = new ]; then path=$PYTHONPATH; else path=/tmp/old-site; fi
        PYTHONPATH=$path t python3 benchmarks/run_layers.py --json "/tmp/layers-$side-$RANDOM.json" || return 1
      done && python3 -c "import glob, json, sys; json.dump([json.load(open(f)) for f in sorted(glob.glob('/tmp/layers-*.json'))], open(sys.argv[1], 'w'), indent=1)" "$OUT/run-layers-h200.json" ;;
    parity)
      t python3 benchmarks/flashinfer_parity/run.py --sample "${PARITY_SAMPLE:-60}" --seed 0 --workers "${PARITY_WORKERS:-8}" \
        --junit "$OUT/flashinfer-parity.xml" --summary "$OUT/flashinfer-parity.md" ;;
    parity-reference)
      t python3 benchmarks/flashinfer_parity/run.py --sample "${PARITY_SAMPLE:-60}" --seed 0 --reference --workers "${PARITY_WORKERS_REFERENCE:-4}" \
        --junit "$OUT/flashinfer-parity-reference.xml" --summary "$OUT/flashinfer-parity-reference.md" ;;
    *) echo "unknown job '$1' (see the list at the top of benchmarks/h200_checks.sh)"; return 2 ;;
  esac
}

for name in "$@"; do
  ( start=$(date +%s); job "$name" > "$LOGS/$name.log" 2>&1
    echo "rc=$? after $(( $(date +%s) - start )) s" >> "$LOGS/$name.log" ) &
done
wait
for f in "$LOGS"/*.log; do
  echo "== $(basename "$f" .log)"
  grep -v "^\s*$" "$f" | grep -v "Synchronization debug\|_cuda_set_sync_debug_mode\|Docs: https" | tail -4
done > "$OUT/summary.log"
tar czf "$OUT/logs.tgz" -C "$LOGS" .
cat "$OUT/summary.log"
