#!/usr/bin/env bash
# One consolidated run on the device tool's H200 (see docs/benchmarks.md). First, here:
#   bash bench/h200-prepare.sh
# then: run(command="bash bench/h200.sh [STAGES...]", carry=[".gl", ".whl", "shaders/build"])
# (and ".pcache" where an earlier call's $OUT/pcache/*.bin.gz were copied there: the driver's pipeline cache)
# Stages: devinfo (the device's features as the backend sees them), ab13 (issue 13: the x16 and dequant options'
# GPU tests, then pp512 of llama-1b Q8_0 and llama-8b Q4_K_M with each, short enough to precede e2e in one call), lcppops (issue 13: llama.cpp Vulkan's own
# per-op GPU times at 32k / 4k, .lcpp carried), ubatch (issue 13: prefill in passes of 512,
# 2048 and 4096 tokens, the server's -ub, backend level), x16 (issue 13: the prefill products on f16
# activations, TRIO_LLM_MATMUL_X16: their tests, then pp512/pp8192 A/B), dequant (issue 13: K-quant prefill
# products through f16 rows, TRIO_LLM_MATMUL_DEQUANT A/B), localmem or rs8 (issue 12: the 8-column
# matvecs' local memory: unrolled in the SPIR-V and/or one row per subgroup, pipemem and batched decode A/B, then coldmem), nv2pp / nv2sweep32 (attn_prefill_nv2 A/B, its tiles), ppdepth (the last pass of a long prefill kernel by kernel), glm (deepseek2's latent kernels, the GLM-4.7-Flash shape), nv2gate (the NV coopmat2 kernels' tests on
# their defaults; a failing kernel is turned off for the later stages, e2e among them), verify (the Vulkan correctness tests on the H200), tune7 (the late 2026-12-01 defaults' tests and choices), tune (decode split, prefill cm, matmul_cm2, norm fusion A/B), cm2 (matmul_cm2's tests and pp512 A/B alone), nv2mm (matmul_nv2 on VK_NV_cooperative_matrix2: its tests, op level beside matmul_cm2, pp512 with TRIO_LLM_MATMUL_NV2=0 / 1), cm2sweep (matmul_cm3's variants: their tests on the GPU, op level against matmul_cm2, pp512 of the best two), prefillcm2 (attn_prefill_cm2's tests, op level and pp8192 A/B), nv2attn (attn_prefill_nv2 on NVIDIA's cooperative_matrix2: its tests on the GPU, op level beside attn_prefill_cm2 with its tiles, pp8192 A/B), attnsweep (attn_prefill_cm3's variants: their tests on the GPU, op level beside attn_prefill_cm2 at 8k / 32k), prefill (prefill attention), decodeg3 (gemma3-4b), attndepth (decode attention at
# depth, op level), decode, decodeab (before/after), qtypes (the newer weight types' mixes),
# vision (gemma-3 with an image: the CPU encoder alone, then through HTTP beside llama-server with the same mmproj),
# decode1b, vkmem, moe (qwen3-30b-a3b Q4_K_M: the MoE kernel tests, then decode/prefill, the pp512 graph
#   with grouped expert matmuls against per-pair matvecs; MOE35=1 adds qwen35-35b-a3b's),
# cpumoe (qwen35-35b-a3b Q4_K_M at --n-cpu-moe 0, 10, 10.5, 20),
# hybrid (the delta-net kernel tests, then qwen35-0.8b Q8_0/Q4_K_M and qwen35-9b Q4_K_M prefill and decode,
#   the delta rule's share of pp512 and its chunked form against the recurrence),
# hybfuse (issue 12: the hybrid/MoE fusions' tests on the GPU, then decode of qwen35-0.8b Q8_0 and
#   qwen35-35b-a3b Q4_K_M with TRIO_LLM_HYBRID_FUSE=0 and =1 (--breakdown) and =1 with the larger groups
#   off (TRIO_LLM_HYBRID_OFF); HYB35=0: the 0.8b only; NO8B=1 spares making the 8b; about 6 minutes),
# batch (batched decode B = 1, 2, 4, 8 alone), residency, handoff, coldmem (issue 12: hybrid models' device memory after POST /sleep?level=all, driver counter too),
# pipemem (issue 12: the driver memory a released model keeps, pipeline by pipeline), coldmem2 (the same through
#   the server without context checkpoints), verifydelta (the delta rule's forms' tests on the GPU),
# server, serverpath (bench/serverpath.py, issue 14), sample (its device-sampling tests), scen1b, scen8b, coresident,
# mvq8 (decode matvecs on int8 activations: their tests, then tune-batch-1b/8b with TRIO_LLM_MATVEC_Q8=0 and 1),
# e2emoe (qwen35-0.8b, qwen3-30b-a3b, qwen35-35b-a3b through HTTP beside llama-server; NO8B=1 skips the 8b),
# mem128k (device memory at -c 131072, q8_0 cache, beside llama-server CUDA; .lcpp too), serve128k (one
# 130,880-token prompt on each model, trio-llm and llama-server CUDA, with the memory after it),
# e2e (bench/e2e.py: trio-llm serve beside llama-server Vulkan and CUDA through HTTP; needs
#   .lcpp carried too: `bash ../shared/tools/llamacpp/prepare.sh` here first).
# Carry ".cc" as well (the shader compiler's wheels) where a stage compiles variants beyond
# compile-shaders' set (verify, prefill, attndepth); not beside .lcpp (64 MiB in all).
# Unpacks the Vulkan loader (.gl/*.deb) and the Python wheels the image lacks (.whl),
# makes the synthetic models, then runs the stages in order, each bounded by `timeout`.
# Everything lands in $OUT/h200.tar.gz (re-packed after every stage, so a run cut
# short still brings back what it finished) plus $OUT/summary.txt.
set -u
OUT=${OUT:-/tmp/h200-out}
mkdir -p "$OUT" /tmp/h200/res /tmp/m
RES=/tmp/h200/res; touch /tmp/h200/start; T0=$(date +%s)
STAGES=${*:-residency handoff scen1b server scen8b}
elapsed() { echo $(( $(date +%s) - T0 )); }

# e2e: llama.cpp's CUDA llama-server builds from the start, in the background (about 5 min
# on the 16 cores), at nice 19 so that our own server, measured meanwhile, keeps its CPU.
# Its own session (setsid), so that the end of this script can stop it by its group id.
LCPP=/tmp/lcpp; CUDA_BUILD=0
case " $STAGES " in *" e2e "*|*" e2emoe "*|*" mem128k "*|*" serve128k "*|*" glm "*|*" vision "*)
  if [ -x $LCPP/cuda/bin/llama-server ] && [ "$(cat $LCPP/cuda.done 2>/dev/null)" = 0 ]; then
    CUDA_BUILD=1  # a warm machine's earlier call built it: used as it is
  elif [ -f .lcpp/h200.sh ] && [ -f .lcpp/src.tgz ] && [ "${E2E_CUDA:-1}" = 1 ]; then
    mkdir -p $LCPP; rm -f $LCPP/cuda.done $LCPP/cuda.pid; CUDA_BUILD=1
    setsid bash -c 'echo $$ > /tmp/lcpp/cuda.pid; nice -n 19 bash .lcpp/h200.sh cuda; echo $? > /tmp/lcpp/cuda.done' \
      > "$RES/lcpp-cuda.log" 2>&1 < /dev/null &
  fi ;;
esac
stop_build() {
  if [ -f $LCPP/cuda.pid ] && [ ! -f $LCPP/cuda.done ]; then
    kill -- -"$(cat $LCPP/cuda.pid)" 2>/dev/null && echo "== CUDA build stopped unfinished" >> "$OUT/summary.txt"
  fi
}
trap stop_build EXIT

# The pipeline cache (vulkan/kernels.py) of an earlier session, carried as .pcache/: the driver builds each
# workgroup-scope (NV cooperative-matrix-2) pipeline in seconds, which ran the GPU test stages out of time; with the
# cache carried, only the shaders changed since cost that. pack() brings the cache back in $OUT/pcache/
export XDG_CACHE_HOME=/tmp/h200-cache
PCACHE_DIR=$XDG_CACHE_HOME/trio-llm/pipelines; mkdir -p "$PCACHE_DIR"
for pc in .pcache/*.bin.gz; do [ -f "$pc" ] && gunzip -c "$pc" > "$PCACHE_DIR/$(basename "$pc" .gz)"; done
if ! ldconfig -p | grep -q libvulkan.so.1; then  # the H200 image has no loader
  for f in .gl/*.deb; do dpkg -x "$f" /; done; ldconfig
fi
NV=/usr/local/nvidia/share
if [ -f $NV/vulkan/icd.d/nvidia_icd.json ]; then
  export VK_DRIVER_FILES=$NV/vulkan/icd.d/nvidia_icd.json
  export __EGL_VENDOR_LIBRARY_FILENAMES=$NV/glvnd/egl_vendor.d/10_nvidia.json
fi
if [ -x .venv/bin/python ]; then PY=.venv/bin/python  # a local dry run
else
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl $(ls .cc/*.whl 2>/dev/null) || exit 1
  export PYTHONPATH=/tmp/site:$PWD/src
  PY=python3
fi
export PYTHONUNBUFFERED=1
# pytest-xdist where the carried wheels have it: the GPU test stages of the workgroup-scope kernels spend most
# of their time in the driver's pipeline builds (seconds each on the H200), which 8 processes do side by side
XD=(); $PY -c "import xdist" 2>/dev/null && XD=(-n 8)
# SMALL=1: the same stages on tiny models, to check the script anywhere
if [ "${SMALL:-0}" = 1 ]; then B1=tiny; B8=tiny-qwen3; else B1=llama-1b; B8=llama-8b; fi

pack() {
  find bench/results -name "*.json" -newer /tmp/h200/start -exec cp {} "$RES/" \;
  (cd /tmp/h200 && tar czf "$OUT/h200.tar.gz" res)
  # the driver's compiled pipelines, for the next session to carry as .pcache/ (see the top)
  # (gzipped: a file comes back only under 16 MiB)
  mkdir -p "$OUT/pcache"
  local pc  # not f: stages loop over f, and pack runs inside their loops
  for pc in "$PCACHE_DIR"/*.bin; do [ -f "$pc" ] && gzip -c "$pc" > "$OUT/pcache/$(basename "$pc").gz"; done
}
say() { echo "== $(date +%T) $*" | tee -a "$OUT/summary.txt"; }
model() { # preset quant -> path, made once
  local p=/tmp/m/$1-$2.gguf
  [ -f "$p" ] || $PY -m trio_llm make-model --preset "$1" --quant "$2" -o "$p" -q >&2
  echo "$p"
}

say "start; stages: $STAGES"
nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv,noheader | tee -a "$OUT/summary.txt"
# the big model is made in the background while the small ones are measured (NO8B=1: not at all)
if [ "${NO8B:-0}" = 1 ]; then M8=""; else ( model $B8 Q4_K_M > /dev/null ) 2> "$RES/make-8b.log" & M8=$!; fi
case " $STAGES " in *" decodeg3 "*|*" vision "*)
  ( model gemma3-4b Q4_K_M > /dev/null ) 2> "$RES/make-gemma3.log" & MG3=$! ;; esac
M1=$(model $B1 Q8_0)
say "$B1 model made"

stage() { # name timeout command...
  local name=$1 limit=$2; shift 2
  say "stage $name"
  timeout -k 10 "$limit" "$@" > "$RES/$name.log" 2>&1
  LAST_RC=$?
  say "stage $name rc=$LAST_RC"; tail -n 25 "$RES/$name.log" >> "$OUT/summary.txt"; pack
}
wait8b() { [ -n "$M8" ] && wait $M8 2>/dev/null; M8B=/tmp/m/$B8-Q4_K_M.gguf; }
# the dense prefill matmuls, matmul_cm (TRIO_LLM_MATMUL_CM2=0) against matmul_cm2 (the default): whole pp512s of
# llama-1b Q8_0 and llama-8b Q4_K_M, and cm2's per-kernel breakdown (its TFLOP/s against tune-ppk-*'s
# matmul_cm figure). Stages tune and cm2; verify first (test_vulkan_ops.py -k cm2 on the real
# cooperative matrices)
cm2_pp512() {
  wait8b
  local mq m tag
  for mq in "$M1:1b-q8" "$M8B:8b-q4km"; do
    m=${mq%%:*}; tag=${mq##*:}
    stage "tune-pp512-$tag-cm" 150 env TRIO_LLM_MATMUL_CM2=0 $PY bench/decode.py --model "$m" --backends vulkan \
      --pp 512 --tg 8 --repeats 3
    stage "tune-pp512-$tag-cm2" 150 env TRIO_LLM_MATMUL_CM2=1 $PY bench/decode.py --model "$m" --backends vulkan \
      --pp 512 --tg 8 --repeats 3 --pp-breakdown
  done
}

run_tunedec() {
  # attention_decode's coalesced form (attn_decode2.comp) beside attn_decode.comp, 2/4/8 rows in flight per lane
  # (1b: also 64-lane groups and 64-key chunks, for the 128-key latency)
  stage tune-attn-decode2-1b 150 $PY bench/attn_depth.py --shape llama-1b --depths 128,640,8192,32768 \
    --types f16,q8_0 --kernels decode,decode2 --decode2-rows 2,4,8 --decode-wg 64,128 --min-chunk 64,128 \
    --repeats 10
  # ... and 4 lanes per row for the 1b's head_dim 64 (two 16-byte pieces per lane: less of the softmax repeated per lane)
  stage tune-attn-decode2-1b-lanes4 90 $PY bench/attn_depth.py --shape llama-1b --depths 128,640,8192,32768 \
    --types f16 --kernels decode,decode2 --decode2-rows 2,4 --decode2-lanes 4,8 --min-chunk 128 --repeats 10
  stage tune-attn-decode2-8b 120 $PY bench/attn_depth.py --shape llama-8b --depths 640,16384 --types f16,q8_0 \
    --kernels decode,decode2 --decode2-rows 2,4,8 --min-chunk 128 --repeats 10
  # the decode norms folded into their matvecs (NORM_IN) against the rms_norm dispatches
  stage tune-decode-1b-nofusenorm 120 env TRIO_LLM_FUSE_NORM=0 $PY bench/decode.py --model "$M1" \
    --backends vulkan --repeats 3
  stage tune-decode-1b-fusenorm 120 env TRIO_LLM_FUSE_NORM=1 $PY bench/decode.py --model "$M1" --backends vulkan \
    --repeats 3 --breakdown
  # batched decode's scaling, backend level (issue 14 part 5): B = 1, 2, 4, 8 sequences per step
  stage tune-batch-1b 120 $PY bench/decode.py --model "$M1" --backends vulkan --pp 64 --tg 64 --repeats 2 \
    --batch-sizes 1,2,4,8
  wait8b
  stage tune-decode-8b-nofusenorm 150 env TRIO_LLM_FUSE_NORM=0 $PY bench/decode.py --model "$M8B" \
    --backends vulkan --repeats 3 --breakdown
  stage tune-decode-8b-fusenorm 150 env TRIO_LLM_FUSE_NORM=1 $PY bench/decode.py --model "$M8B" --backends vulkan \
    --repeats 3
  stage tune-batch-8b 150 $PY bench/decode.py --model "$M8B" --backends vulkan --pp 64 --tg 64 --repeats 2 \
    --batch-sizes 1,2,4,8
}
run_prefillcm2() {
  # attn_prefill_cm2 (each subgroup owns its 16 query rows, 2 work-group barriers per key tile; off by default,
  # TRIO_LLM_PREFILL_CM2=1): its tests on the real cooperative matrices first (the ops fixture's coopmat2 rows; its
  # emulated ones too, under the GPU's real concurrency, which lavapipe lacks), then beside attn_prefill_cm op level
  # at 512 / 8k (its keys per tile, its splits), then a whole pp8192 both ways. NO8B=1 skips making the 8b file
  # (not used here: bench/prefill.py's shapes are synthetic)
  stage verify-prefill-cm2 150 $PY -m pytest -q -p no:cacheprovider -rs tests/test_vulkan_attn_prefill.py \
    tests/test_vulkan_model.py -k "coopmat2 or cm2"
  stage tune-prefill-cm2-1b 120 $PY bench/prefill.py --shape llama-1b --lengths 512,8192 --types f16 --repeats 1 \
    --kernels prefill_cm,prefill_cm2,prefill_cm2_k32,prefill_cm_split2,prefill_cm2_split2,prefill_cm_split4,prefill_cm2_split4
  # llama-8b (head_dim 128): 32 keys per tile on 64-row tiles, 64 keys on 32-row tiles (prefill_cm2_r32)
  stage tune-prefill-cm2-8b 150 $PY bench/prefill.py --shape llama-8b --lengths 512,8192 --types f16 --repeats 1 \
    --rows-cm 0,32 --kernels prefill_cm,prefill_cm2,prefill_cm2_r32,prefill_cm2_k16,prefill_cm_split2,prefill_cm2_split2
  stage tune-pp8192-1b-cm 120 $PY bench/decode.py --model "$M1" --backends vulkan --pp 8192 --tg 8 --repeats 2
  stage tune-pp8192-1b-cm2 120 env TRIO_LLM_PREFILL_CM2=1 $PY bench/decode.py --model "$M1" --backends vulkan \
    --pp 8192 --tg 8 --repeats 2
}

run_tunepp() {
  # prefill attention op level: scalar tiled, coopmat (its tiles, staged, key splits), 512 / 8k / 32k
  # (512 and 8k only: at 32k the scalar rows alone ran past 200 s in session 5)
  stage tune-prefill-attn-1b 100 $PY bench/prefill.py --shape llama-1b --lengths 512,8192 --types f16 \
    --old-max 0 --repeats 1
  stage tune-pp8192-1b 120 $PY bench/decode.py --model "$M1" --backends vulkan --pp 8192 --tg 8 --repeats 2
  stage tune-pp8192-1b-scalar 120 env TRIO_LLM_PREFILL_CM=0 $PY bench/decode.py --model "$M1" --backends vulkan \
    --pp 8192 --tg 8 --repeats 2
  stage tune-pp8192-1b-cm2 120 env TRIO_LLM_PREFILL_CM2=1 $PY bench/decode.py --model "$M1" --backends vulkan \
    --pp 8192 --tg 8 --repeats 2
  stage tune-prefill-cm2-1b 120 $PY bench/prefill.py --shape llama-1b --lengths 512,8192 --types f16 --repeats 1 \
    --kernels prefill_cm,prefill_cm2,prefill_cm2_k32,prefill_cm_split2,prefill_cm2_split2,prefill_cm_split4,prefill_cm2_split4
  # where pp512 spends its time, per kernel (the matmuls' TFLOP/s), then the dense matmuls on matmul_cm2
  stage tune-ppk-1b 120 $PY bench/decode.py --model "$M1" --backends vulkan --pp 512 --tg 8 --repeats 2 --pp-breakdown
  wait8b
  stage tune-ppk-8b 150 $PY bench/decode.py --model "$M8B" --backends vulkan --pp 512 --tg 8 --repeats 2 --pp-breakdown
  cm2_pp512
}

for s in $STAGES; do case $s in
  devinfo)  # the device as the backend opens it: features (NV cooperative matrices 2 among them), limits
    stage devinfo 60 $PY -c "import json, logging; logging.basicConfig(level=logging.INFO)
from trio_llm.vulkan.device import shared_device
d = shared_device(); print(json.dumps(d.info(), default=str)); print('nv_coopmat2', d.nv_coopmat2, d.nv_coopmat2_max_wg)
print(sorted(e for e in d.extensions if 'cooperative' in e))" ;;
  verify)  # the model equivalence (Vulkan = numpy within 1e-4) on the float32 scalar matmul;
    # the cooperative-matrix matmul (f16 tiles) is checked op by op in test_vulkan_ops.py
    stage verify 300 $PY -m pytest -q -p no:cacheprovider -rs tests/test_vulkan_ops.py tests/test_vulkan_kv.py \
      tests/test_vulkan_attn_prefill.py tests/test_vulkan_norm_fusion.py
    # attn_decode2 (the default; TRIO_LLM_ATTN_DECODE2=0 keeps attn_decode): 16- and 32-lane row groups and the split combine's
    # memory ordering, which lavapipe (8-lane subgroups, no real concurrency) cannot show
    stage verify-decode2 150 $PY -m pytest -q -p no:cacheprovider -rs tests/test_vulkan_decode2.py
    stage verify-model 200 env TRIO_LLM_COOPMAT=0 $PY -m pytest -q -p no:cacheprovider tests/test_vulkan_model.py
    # the MoE kernels, the prefill path's device-side grouping (shared atomics, scan) and grouped expert matmuls
    # (scalar dense matmuls, as verify-model: the model-level checks hold Vulkan to numpy at f32 tolerances)
    stage verify-moe 150 env TRIO_LLM_COOPMAT=0 $PY -m pytest -q -p no:cacheprovider tests/test_vulkan_moe.py \
      -k "not cm"
    # moe_matmul_cm on the real cooperative matrices (off by default, TRIO_LLM_MOE_CM=1, until this passes)
    stage verify-moe-cm 120 $PY -m pytest -q -p no:cacheprovider -rs tests/test_vulkan_moe.py -k cm
    # sampling on the device = the host chain for the same seeds (issue 14), op level and through the slots loop
    stage verify-sample 150 $PY -m pytest -q -p no:cacheprovider tests/test_devsample.py tests/test_server_decode.py ;;
  prefill)  # prefill attention of whole prompts, op level (bench/prefill.py: the old per-head kernel up to 8k,
    # the tiled one, its cooperative-matrix form), then whole prefills of 8k / 32k through the backend
    if [ "${SMALL:-0}" = 1 ]; then S1=tiny; S8=tiny; LP=512,1100; L8=600; LT=1100; PP1=600; PP2=1100
    else S1=llama-1b; S8=llama-8b; LP=512,8192,32768; L8=512,8192,16384; LT=8192,32768; PP1=8192; PP2=32768; fi
    stage prefill-attn-1b 300 $PY bench/prefill.py --shape $S1 --lengths $LP --types f16,q8_0 \
      --rows 0,16 --rows-cm 0,32
    stage prefill-attn-8b 240 $PY bench/prefill.py --shape $S8 --lengths $L8 --types f16 --rows-cm 0,32
    for n in 16 64; do  # n new tokens after a cached prefix: the tiled kernels against attention_decode
      stage "prefill-tail$n-1b" 120 $PY bench/prefill.py --shape $S1 --lengths $LT --tail $n --types f16
    done
    stage prefill-pp$PP1-1b 150 $PY bench/decode.py --model "$M1" --backends vulkan --pp $PP1 --tg 8 --repeats 2
    stage prefill-pp$PP2-1b 240 $PY bench/decode.py --model "$M1" --backends vulkan --pp $PP2 --tg 8 --repeats 2 ;;
  tune)  # both halves below, tunedec then tunepp (more than one 10-minute call: split them there)
    run_tunedec; run_tunepp ;;
  tunedec)  # decode's choices (carry .cc): attn_decode2 against attn_decode, NORM_IN, batched steps
    run_tunedec ;;
  tunepp)  # prefill's choices (carry .cc): coopmat attention op level, 8k both ways, pp512 per kernel, matmul_cm2
    run_tunepp ;;
  tune7)  # the defaults of 2026-12-01 late (carry .cc): decode matvecs on int8 activations from 2 columns and
    # attn_prefill_cm2 at its preferred keys per tile, their tests on the GPU (the model-level ones on the scalar
    # matmuls, as verify-model), then prefill attention op level at 8k / 32k (its keys, a split), whole pp8192 and
    # pp32768 on llama-1b, and matmul_cm2's fewest work groups (cm2_tile) 256 against 128 on pp512 of both models
    stage verify7 300 $PY -m pytest -q -p no:cacheprovider -rs tests/test_vulkan_mvq8.py tests/test_vulkan_attn_prefill.py \
      tests/test_devsample.py tests/test_server_decode.py
    stage verify7-model 200 env TRIO_LLM_COOPMAT=0 $PY -m pytest -q -p no:cacheprovider tests/test_vulkan_model.py
    stage tune7-prefill-1b 150 $PY bench/prefill.py --shape llama-1b --lengths 8192,32768 --types f16,q8_0 --repeats 1 \
      --kernels prefill_cm,prefill_cm2,prefill_cm2_k16,prefill_cm2_k64,prefill_cm2_split2
    stage tune7-prefill-8b 150 $PY bench/prefill.py --shape llama-8b --lengths 8192 --types f16,q8_0 --repeats 1 \
      --kernels prefill_cm,prefill_cm2,prefill_cm2_k32,prefill_cm2_split2
    stage tune7-prefill-g3 120 $PY bench/prefill.py --shape gemma3-4b --lengths 8192 --types f16 --repeats 1 \
      --kernels prefill_cm,prefill_cm2,prefill_cm2_k32
    stage tune7-pp8192-1b 120 $PY bench/decode.py --model "$M1" --backends vulkan --pp 8192 --tg 8 --repeats 2
    stage tune7-pp32k-1b 150 $PY bench/decode.py --model "$M1" --backends vulkan --pp 32768 --tg 8 --repeats 1
    wait8b
    for mg in 256 128; do
      stage "tune7-pp512-1b-mg$mg" 90 env TRIO_LLM_CM2_MIN_GROUPS=$mg $PY bench/decode.py --model "$M1" --backends vulkan \
        --pp 512 --tg 8 --repeats 2
      stage "tune7-pp512-8b-mg$mg" 120 env TRIO_LLM_CM2_MIN_GROUPS=$mg $PY bench/decode.py --model "$M8B" --backends vulkan \
        --pp 512 --tg 8 --repeats 2
    done ;;
  attnsweep)  # attn_prefill_cm3's variants (TRIO_LLM_PREFILL_CM2_VARIANT; all prebuilt by compile-shaders
    # --cm3-sweep, so no .cc): the ops fixture's coopmat3 rows on the real cooperative matrices (f16 / q8_0 cases,
    # the prebuilt ones), then op level beside attn_prefill_cm2 (bench/prefill.py, all layers): llama-1b at 8k
    # and 32k in f16 (unsplit; split in 4, as the forward pass splits 32k, for ATTN_VS) and 32k in q8_0, llama-8b
    # at 8k and gemma3-4b at 8k in f16 and q8_0 (beside attn_prefill_cm, its kernel at head_dim 256). ATTN_V="v
    # v+db" names the variants instead of the sweep, ATTN_VS the split ones. About 3 minutes (NO8B=1: the 8b
    # file is not used).
    AV=${ATTN_V:-$($PY -c "from trio_llm.vulkan.shaders import ATTN_SWEEP; print(' '.join(ATTN_SWEEP))")}
    AVC=$(echo $AV | tr ' ' ','); AK=$(for v in $AV; do printf ',cm3_%s' "$v"; done)
    AKS=$(for v in ${ATTN_VS:-v v+db+lr v+rb2+db+lr v+db+lr+pr v+db+k64}; do printf ',cm3_%s_split4' "$v"; done)
    if [ "${SMALL:-0}" = 1 ]; then ASW=(--emulate --layers 1); AL1=512; AL2=1024; AS=tiny; else ASW=(); AL1=8192; AL2=32768; AS=; fi
    stage verify-attn-cm3 120 $PY -m pytest -q -p no:cacheprovider -rs tests/test_vulkan_attn_prefill.py \
      -k "coopmat3 and not every_kv_type and not mixed"
    stage attnsweep-1b 200 $PY bench/prefill.py --shape ${AS:-llama-1b} --lengths $AL1,$AL2 --types f16 --repeats 1 \
      ${ASW[@]+"${ASW[@]}"} --splits 4 --variants "$AVC" --kernels "prefill_cm2,prefill_cm2_split4$AK$AKS"
    [ "${ATTN_1B:-0}" = 1 ] && continue  # ATTN_1B=1: the tests and llama-1b's f16 rows only
    stage attnsweep-1b-q8 100 $PY bench/prefill.py --shape ${AS:-llama-1b} --lengths $AL2 --types q8_0 --repeats 1 \
      ${ASW[@]+"${ASW[@]}"} --splits 4 --variants "$AVC" --kernels "prefill_cm2,prefill_cm2_split4$AK"
    stage attnsweep-8b 90 $PY bench/prefill.py --shape ${AS:-llama-8b} --lengths $AL1 --types f16,q8_0 --repeats 1 \
      ${ASW[@]+"${ASW[@]}"} --variants "$AVC" --kernels "prefill_cm2$AK"
    stage attnsweep-g3 120 $PY bench/prefill.py --shape ${AS:-gemma3-4b} --lengths $AL1 --types f16,q8_0 --repeats 1 \
      ${ASW[@]+"${ASW[@]}"} --variants "$AVC" --kernels "prefill_cm$AK" ;;
  nv2gate)  # the NV cooperative-matrix-2 kernels' GPU tests on what the defaults run (attn_prefill_nv2's default
    # form and tile over head dims, GQA, cache types, sequences, windows, splits, long prompts, the model; matmul_nv2's
    # default types), then attention op level at 32k beside attn_prefill_cm2. A kernel whose tests fail is turned off
    # (TRIO_LLM_PREFILL_NV2=0 / TRIO_LLM_MATMUL_NV2=0) for the stages after this one (e2e), and the summary says so
    stage verify-nv2gate-attn ${NV2GATE_S:-150} $PY -m pytest -q -p no:cacheprovider -rs ${XD[@]+"${XD[@]}"} tests/test_vulkan_nv2_attn.py -k \
      "(head_dims or every_kv or straddle or window or split or long_prompt or against_numpy or through_the_backend) and not direct"
    # (attn_prefill_nv2 is opt-in: TRIO_LLM_PREFILL_NV2=1 turns it on for the later stages where its tests pass)
    if [ "$LAST_RC" != 0 ]; then export TRIO_LLM_PREFILL_NV2=0; say "attn_prefill_nv2 OFF for what follows (rc=$LAST_RC)"
    else export TRIO_LLM_PREFILL_NV2=1; say "attn_prefill_nv2 ON for what follows"; fi
    stage verify-nv2gate-mm ${NV2GATE_MM_S:-75} $PY -m pytest -q -p no:cacheprovider -rs ${XD[@]+"${XD[@]}"} tests/test_vulkan_nv2_matmul.py -k \
      "(Q8_0 or F16 or Q4_0 or small_batch or model_shapes or default) and not x16 and not f16_activations"
    if [ "$LAST_RC" != 0 ]; then export TRIO_LLM_MATMUL_NV2=0; say "matmul_nv2 OFF for what follows (rc=$LAST_RC)"; fi
    if [ "${TRIO_LLM_PREFILL_NV2:-1}" = 1 ] && [ "${NV2GATE_OPS:-1}" = 1 ]; then
      stage nv2gate-attn-32k 75 $PY bench/prefill.py --shape llama-1b --lengths 32768 --types f16 --repeats 1 --splits 4 \
        --kernels prefill_cm2,prefill_cm2_split4,prefill_nv2,prefill_nv2_split4 --check
    fi ;;
  rs8|localmem)  # issue 12's cold memory: the 8-column matvecs that kept 64 bytes a thread of local memory, which the
    # driver holds for the device's life. Forms (LM_FORMS): base (today's), unroll8 (TRIO_LLM_MATVEC_UNROLL=8: the
    # column count and rows per subgroup fixed, every loop over them unrolled in the SPIR-V, no array left), rs8
    # (TRIO_LLM_MATVEC_RS8=1: one row per subgroup at 8 columns), both, and split8 (TRIO_LLM_MATVEC_SPLIT8=1: the
    # 8-column bucket as two 4-column dispatches, no 8-column pipeline at all). Per form: pipemem on qwen35-0.8b (its
    # "local memory above the floor" lines), batched decode of qwen35-0.8b and llama-1b at B = 1, 4, 8; then
    # coldmem through the server (the driver's counter, issue 12's <= 5 %) for the first form with no local memory
    Q08=$(model qwen35-0.8b Q4_K_M)
    LM_FORMS=${LM_FORMS:-base unroll8 rs8 unroll8+rs8 split8}
    lm_env() { LE=(); case $1 in *unroll8*) LE+=(TRIO_LLM_MATVEC_UNROLL=8) ;; esac
      case $1 in *rs8*) LE+=(TRIO_LLM_MATVEC_RS8=1) ;; esac
      case $1 in *split8*) LE+=(TRIO_LLM_MATVEC_SPLIT8=1) ;; esac; }
    for f in $LM_FORMS; do
      lm_env "$f"
      stage "localmem-pipemem-$f" 90 env ${LE[@]+"${LE[@]}"} TRIO_LLM_PIPELINE_STATS=1 $PY bench/pipemem.py --model "$Q08"
      for m in "$Q08" "$M1"; do
        stage "localmem-batch-$(basename "$m" .gguf)-$f" 90 env ${LE[@]+"${LE[@]}"} $PY bench/decode.py --model "$m" \
          --backends vulkan --pp 64 --tg 64 --repeats 2 --batch-sizes 1,4,8
      done
    done
    for f in $LM_FORMS; do
      grep -q "every pipeline at the floor" "$RES/localmem-pipemem-$f.log" || continue
      lm_env "$f"
      stage "localmem-coldmem-$f" 150 env ${LE[@]+"${LE[@]}"} $PY bench/coldmem.py --model "$Q08" --model "$M1" \
        --backend vulkan --log-dir "$RES/coldmem-logs-$f"
      break
    done ;;
  ab13)  # issue 13's two pending prefill-product options in one short stage (x16 and dequant at once, for a call
    # that also runs e2e while CUDA builds): their GPU tests, then pp512 with --pp-breakdown: llama-1b Q8_0 at the
    # defaults, X16=1 and DEQUANT=Q8_0; llama-8b Q4_K_M at the defaults, DEQUANT=1, X16=1 and both
    stage verify-ab13 150 $PY -m pytest -q -p no:cacheprovider -rs ${XD[@]+"${XD[@]}"} tests/test_vulkan_nv2_matmul.py \
      tests/test_vulkan_ops.py tests/test_vulkan_dequant.py -k "(x16 or f16_activations or dequant) and not emulated"
    [ "$LAST_RC" = 0 ] || say "ab13: tests failed (rc=$LAST_RC); the A/B runs anyway, for the figures only"
    for e in "base:" "x16:TRIO_LLM_MATMUL_X16=1" "dqq8:TRIO_LLM_MATMUL_DEQUANT=Q8_0"; do
      stage "ab13-1b-pp512-${e%%:*}" 60 env ${e#*:} $PY bench/decode.py --model "$M1" --backends vulkan \
        --pp 512 --tg 8 --repeats 3 --pp-breakdown
    done
    wait8b
    for e in "base:" "dq:TRIO_LLM_MATMUL_DEQUANT=1" "x16:TRIO_LLM_MATMUL_X16=1" \
             "dqx16:TRIO_LLM_MATMUL_DEQUANT=1 TRIO_LLM_MATMUL_X16=1"; do
      stage "ab13-8b-pp512-${e%%:*}" 75 env ${e#*:} $PY bench/decode.py --model "$M8B" --backends vulkan \
        --pp 512 --tg 8 --repeats 3 --pp-breakdown
    done ;;
  x16)  # issue 13: the prefill products on f16 activations (TRIO_LLM_MATMUL_X16=1: to_f16.comp once per product
    # input; matmul_nv2's and matmul_cm2's X_F16 variants read them as they are, as llama.cpp's coopmat2 products do):
    # their GPU tests, then whole pp512s of llama-1b Q8_0 (matmul_nv2) and llama-8b Q4_K_M (K-quants on matmul_cm2,
    # and through f16 rows on matmul_nv2 with TRIO_LLM_MATMUL_DEQUANT=1) with X16 off / on, and pp8192 of the 1b
    # both ways. The A/B only where the tests pass
    stage verify-x16 150 $PY -m pytest -q -p no:cacheprovider -rs ${XD[@]+"${XD[@]}"} tests/test_vulkan_nv2_matmul.py \
      tests/test_vulkan_ops.py -k "(x16 or f16_activations) and not emulated"
    [ "$LAST_RC" = 0 ] || { say "x16: tests failed (rc=$LAST_RC), no A/B"; continue; }
    for x in 0 1; do
      stage "x16-1b-pp512-x$x" 90 env TRIO_LLM_MATMUL_X16=$x $PY bench/decode.py --model "$M1" --backends vulkan \
        --pp 512 --tg 8 --repeats 3 --pp-breakdown
      stage "x16-1b-pp8192-x$x" 90 env TRIO_LLM_MATMUL_X16=$x $PY bench/decode.py --model "$M1" --backends vulkan \
        --pp 8192 --tg 8 --repeats 2
    done
    wait8b
    for x in 0 1; do for dq in 0 1; do
      stage "x16-8b-pp512-x$x-dq$dq" 120 env TRIO_LLM_MATMUL_X16=$x TRIO_LLM_MATMUL_DEQUANT=$dq $PY bench/decode.py \
        --model "$M8B" --backends vulkan --pp 512 --tg 8 --repeats 3 --pp-breakdown
    done; done ;;
  dequant)  # issue 13's K-quant prefill: TRIO_LLM_MATMUL_DEQUANT=1 (each K-quant piece decoded to f16 rows by
    # dequant_f16.comp, then matmul_nv2's F16 path) against today's matmul_cm2, whole prefills of llama-8b Q4_K_M at
    # 512 and 4096 tokens (the breakdown at 512 says what the decode pass costs), then qwen35-9b Q4_K_M at 512
    # llama-1b Q8_0 too (TRIO_LLM_MATMUL_DEQUANT=Q8_0): matmul_nv2 decodes Q8_0 in its loads; is F16 after a
    # decode pass faster? (its pp512 is 10.3 of 14.2 ms in matmul_nv2, 2026-12-04)
    for dq in 0 Q8_0; do
      stage "dequant-1b-pp512-dq$dq" 90 env TRIO_LLM_MATMUL_DEQUANT=$dq $PY bench/decode.py --model "$M1" \
        --backends vulkan --pp 512 --tg 8 --repeats 3 --pp-breakdown
    done
    wait8b
    Q9=$(model qwen35-9b Q4_K_M)
    for mq in "$M8B:8b:512,4096" "$Q9:q9b:512"; do
      m=${mq%%:*}; rest=${mq#*:}; tag=${rest%%:*}; pps=${rest#*:}
      for pp in ${pps//,/ }; do for dq in 0 1; do
        stage "dequant-$tag-pp$pp-dq$dq" 120 env TRIO_LLM_MATMUL_DEQUANT=$dq $PY bench/decode.py --model "$m" \
          --backends vulkan --pp "$pp" --tg 8 --repeats 3 $([ "$pp" = 512 ] && echo --pp-breakdown)
      done; done
    done ;;
  ppdepth)  # issue 13: where the last 512-token pass of a long prefill spends its GPU time, kernel by kernel
    # (bench/decode.py --pp-breakdown times a pp above --max-chunk as its last pass, the cache holding the rest):
    # llama-1b at 512 (no depth), 8192 and 32768; llama-8b at 512 and 4096. What grows with depth besides attention
    for L in ${PD_1B-512 8192 32768}; do
      stage "ppdepth-1b-$L" 90 $PY bench/decode.py --model "$M1" --backends vulkan --pp "$L" --tg 4 --repeats 1 \
        --warmup 0 --pp-breakdown
    done
    wait8b
    for L in ${PD_8B-512 4096}; do
      stage "ppdepth-8b-$L" 90 $PY bench/decode.py --model "$M8B" --backends vulkan --pp "$L" --tg 4 --repeats 1 \
        --warmup 0 --pp-breakdown
    done ;;
  ubatch)  # issue 13: the physical batch (-ub) above 512: whole prefills through the backend in passes of 512
    # (today's default, llama-server's), 2048 and 4096 tokens (bench/decode.py --max-chunk): llama-1b at 8k and 32k,
    # llama-8b at 4096 (its matmuls at 512 tokens ran at 11-44 TFLOP/s, at 2048 up to 62-90; a 32k prefill in passes
    # of 512 reads the prefix's K and V 64 times). UB_SIZES, UB_1B, UB_8B change the sets. First its tests on the GPU
    # (the 2048 and 4096 buckets against numpy: the cooperative-matrix kernels have never run on so many tokens)
    stage verify-ubatch 120 $PY -m pytest -q -p no:cacheprovider -rs ${XD[@]+"${XD[@]}"} tests/test_vulkan_ubatch.py
    [ "$LAST_RC" = 0 ] || say "ubatch: tests failed (rc=$LAST_RC); the A/B runs anyway, for the figures only"
    for L in ${UB_1B:-8192 32768}; do for c in ${UB_SIZES:-512 2048 4096}; do
      stage "ubatch-1b-pp$L-ub$c" 90 $PY bench/decode.py --model "$M1" --backends vulkan --pp "$L" --tg 8 \
        --repeats 2 --max-chunk "$c"
    done; done
    wait8b
    for L in ${UB_8B:-4096}; do for c in ${UB_SIZES:-512 2048 4096}; do
      stage "ubatch-8b-pp$L-ub$c" 120 $PY bench/decode.py --model "$M8B" --backends vulkan --pp "$L" --tg 8 \
        --repeats 2 --max-chunk "$c"
    done; done ;;
  nv2pp)  # attn_prefill_nv2 against attn_prefill_cm2 in whole prefills of llama-1b (8k, 32k), backend level
    for L in 8192 32768; do for nv in 0 1; do
      stage "nv2pp-$L-nv2-$nv" 60 env TRIO_LLM_PREFILL_NV2=$nv $PY bench/decode.py --model "$M1" --backends vulkan \
        --pp $L --tg 8 --repeats 2
    done; done ;;
  nv2sweep32)  # attn_prefill_nv2's tiles and forms at 32k, op level, llama-1b f16, beside attn_prefill_cm2
    NV2S=${NV2S:-64x32x128:pf,64x32x128:direct,64x32x128:pf+lsum,64x64x128:direct,64x64x128:direct+lsum,64x64x128:direct+mma,64x32x128:pf+mma}
    NK=$(for v in ${NV2S//,/ }; do printf ',nv2_%s' "$v"; done)
    stage nv2sweep-32k 150 $PY bench/prefill.py --shape llama-1b --lengths 32768 --types f16 --repeats 1 \
      --nv2 "$NV2S" --kernels "prefill_cm2$NK" --check ;;
  nv2attn)  # attn_prefill_nv2 (VK_NV_cooperative_matrix2; its variants prebuilt by compile-shaders where slangpy is
    # installed here, so no .cc): the device's NV coopmat2 features as device.py logs them, its tests on the GPU,
    # op level beside attn_prefill_cm2 (llama-1b at 8k and 32k in f16, unsplit and split in 4 as the forward pass
    # splits 32k, 32k in q8_0, llama-8b at 8k; at 8k its tiles and forms too: NV2S="ROWSxKEYSxLANES:FORM,..."),
    # then a whole pp8192 of llama-1b with TRIO_LLM_PREFILL_NV2=0 and =1. About 5 minutes (NO8B=1: the 8b file is
    # not used)
    stage nv2attn-devinfo 60 $PY -c "import logging; logging.basicConfig(level=logging.INFO)
from trio_llm.vulkan.device import shared_device
d = shared_device(); print('nv_coopmat2', d.nv_coopmat2, 'max_wg', d.nv_coopmat2_max_wg, 'shared', d.limits.max_shared_memory)"
    stage verify-nv2attn 240 $PY -m pytest -q -p no:cacheprovider -rs ${XD[@]+"${XD[@]}"} tests/test_vulkan_nv2_attn.py
    NV2S=${NV2S:-64x64x128:pf+mma,64x32x128:pf,128x64x256:pf,64x64x256:pf,64x64x128:staged,64x64x128:direct,128x64x256:direct}
    NK=$(for v in ${NV2S//,/ }; do printf ',nv2_%s' "$v"; done)
    if [ "${SMALL:-0}" = 1 ]; then NL1=512; NL2=1024; NS1=tiny; NS8=tiny; else NL1=8192; NL2=32768; NS1=llama-1b; NS8=llama-8b; fi
    stage nv2attn-1b 120 $PY bench/prefill.py --shape $NS1 --lengths $NL1 --types f16 --repeats 1 --splits 4 \
      --nv2 "$NV2S" --kernels "prefill_cm2,prefill_nv2$NK"
    stage nv2attn-1b-32k 120 $PY bench/prefill.py --shape $NS1 --lengths $NL2 --types f16,q8_0 --repeats 1 --splits 4 \
      --kernels prefill_cm2,prefill_cm2_split4,prefill_nv2,prefill_nv2_split4
    stage nv2attn-8b 90 $PY bench/prefill.py --shape $NS8 --lengths $NL1 --types f16 --repeats 1 --splits 4 \
      --nv2 "$NV2S" --kernels "prefill_cm2,prefill_nv2$NK"
    for nv in 0 1; do
      stage "nv2attn-pp8192-1b-nv2-$nv" 120 env TRIO_LLM_PREFILL_NV2=$nv $PY bench/decode.py --model "$M1" \
        --backends vulkan --pp 8192 --tg 8 --repeats 2
    done ;;
  prefillcm2)  # attn_prefill_cm2 alone (carry .cc): its tests on the GPU, op level beside attn_prefill_cm, pp8192 A/B
    run_prefillcm2 ;;
  cm2)  # matmul_cm2 alone (issue 13 item 3; carry .cc: the emulated test variants): its tests on the real
    # cooperative matrices and emulated, the prefill lowering on it, then tune's pp512 A/B
    stage verify-cm2 150 $PY -m pytest -q -p no:cacheprovider -rs tests/test_vulkan_ops.py \
      tests/test_vulkan_model.py -k cm2
    cm2_pp512
    # each tile forced on every product (TRIO_LLM_CM2_TILE; ops.cm2_tile's choice is the run above), to set
    # ops.CM2_MIN_GROUPS
    for mq in "$M1:1b-q8" "$M8B:8b-q4km"; do
      m=${mq%%:*}; tag=${mq##*:}
      for t in 128x128 128x64 64x64; do
        stage "cm2-pp512-$tag-$t" 120 env TRIO_LLM_MATMUL_CM2=1 TRIO_LLM_CM2_TILE=$t $PY bench/decode.py \
          --model "$m" --backends vulkan --pp 512 --tg 8 --repeats 2
      done
    done ;;
  nv2mm)  # matmul_nv2 (VK_NV_cooperative_matrix2, the default where the device has it): its tests on the GPU
    # (every weight type and tile, ragged edges; the summary's skip line says so where the extension is missing),
    # then op level beside matmul_cm2 (bench/matmul.py --variants cm2,nv2: llama-1b's products in Q8_0, llama-8b's
    # in Q4_K and Q6_K, 512 and 2048 tokens; --check holds nv2's y to cm2's, BAD where not), every tile forced at
    # 512 (Q8_0 / Q4_K), then whole pp512s of both models with TRIO_LLM_MATMUL_NV2=0 (matmul_cm2), =1 (the default
    # types: Q8_0 etc., not the K-quants) and =all (every type).
    # The prebuilt set (compile-shaders with slangpy installed here) holds every variant the tests ask for.
    # About 6 minutes
    # (the driver takes seconds to build each workgroup-scope pipeline: about 30 of them, 2-3 minutes)
    stage verify-nv2 300 $PY -m pytest -q -p no:cacheprovider -rs ${XD[@]+"${XD[@]}"} tests/test_vulkan_nv2_matmul.py
    if [ "${SMALL:-0}" = 1 ]; then SW=(--shapes small --tokens 64 --repeats 1); else SW=(); fi
    stage nv2mm-ops 150 $PY bench/matmul.py ${SW[@]+"${SW[@]}"} --variants cm2,nv2
    if [ "${SMALL:-0}" = 1 ]; then SW=(--shapes small --tokens 64 --repeats 1); else SW=(--tokens 512); fi
    stage nv2mm-tiles 120 $PY bench/matmul.py "${SW[@]}" --types main --variants cm2,nv2 \
      --tiles all
    wait8b
    for mq in "$M1:1b-q8" "$M8B:8b-q4km"; do
      m=${mq%%:*}; tag=${mq##*:}
      for v in 0 1 all; do  # all: the K-quants on matmul_nv2 too (by default they keep matmul_cm2)
        stage "nv2mm-pp512-$tag-nv2$v" 90 env TRIO_LLM_MATMUL_NV2=$v $PY bench/decode.py --model "$m" --backends vulkan \
          --pp 512 --tg 8 --repeats 2 --pp-breakdown
      done
    done ;;
  cm2sweep)  # matmul_cm3's variants (TRIO_LLM_CM2_VARIANT; carry .cc too: the F16 test variants compile there):
    # their tests on the real cooperative matrices (every variant x tile the H200's 48 KiB takes), then op level
    # beside matmul_cm2 (bench/matmul.py: llama-1b's products in Q8_0, llama-8b's in Q4_K and Q6_K, 512 and 2048
    # tokens on the backend's tiles, then at 512 every tile forced, Q8_0 / Q4_K), then whole pp512s of both models on
    # matmul_cm2 and on the two variants with the lowest layer time (its --best-out; CM3_PP="v+db+direct ..."
    # names them instead). About 5 minutes.
    # (the emulated cases ran here on lavapipe; only the small batch of them there, each compiles)
    stage verify-cm3 200 $PY -m pytest -q -p no:cacheprovider -rs tests/test_vulkan_ops.py \
      -k "cm3_on or cm3_emulated_small or cm2_choice"
    if [ "${SMALL:-0}" = 1 ]; then SW=(--shapes small --emulate --tokens 64 --repeats 1); else SW=(); fi
    stage cm2sweep-ops 200 $PY bench/matmul.py ${SW[@]+"${SW[@]}"} --best 2 --best-out "$RES/cm3-best.txt"
    if [ "${SMALL:-0}" = 1 ]; then SW=(--shapes small --emulate --tokens 64 --repeats 1); else SW=(--tokens 512); fi
    stage cm2sweep-tiles 200 $PY bench/matmul.py "${SW[@]}" --types main --tiles all
    wait8b
    PPV=${CM3_PP:-$(cat "$RES/cm3-best.txt" 2>/dev/null)}
    for mq in "$M1:1b-q8" "$M8B:8b-q4km"; do
      m=${mq%%:*}; tag=${mq##*:}
      for v in cm2 $PPV; do
        stage "cm2sweep-pp512-$tag-$v" 90 env TRIO_LLM_CM2_VARIANT=$v $PY bench/decode.py --model "$m" --backends vulkan \
          --pp 512 --tg 8 --repeats 2 --pp-breakdown
      done
    done ;;
  attndepth)  # decode attention at depth, op level: per-head attention vs attention_decode
    stage attn-depth-1b 240 $PY bench/attn_depth.py --shape llama-1b --depths 512,4096,32768,131072 \
      --types f16,q8_0,f32 --min-chunk 128,256,512
    stage attn-depth-8b 240 $PY bench/attn_depth.py --shape llama-8b --depths 512,4096,32768 \
      --types f16,q8_0 --min-chunk 256,512 ;;
  decode)
    stage decode-1b-q8 120 $PY bench/decode.py --model "$M1" --backends vulkan --repeats 3 --residency
    stage decode-1b-q4km 100 $PY bench/decode.py --model "$(model $B1 Q4_K_M)" --backends vulkan --repeats 3
    wait8b
    stage decode-8b-q4km 150 $PY bench/decode.py --model "$M8B" --backends vulkan --repeats 3 --residency ;;
  decodeab)  # the decode benchmark of an older tree in $BEFORE (default .before), then this one's
    B=${BEFORE:-.before}
    wait8b
    for mq in "$M1:1b-q8" "$M8B:8b-q4km"; do
      m=${mq%%:*}; tag=${mq##*:}
      stage "decode-$tag-before" 150 env PYTHONPATH=/tmp/site:$PWD/$B/src $PY $B/bench/decode.py --model "$m" \
        --backends vulkan --repeats 3
      find $B/bench/results -name "*.json" -newer /tmp/h200/start -exec cp {} "$RES/before-$tag.json" \;
      stage "decode-$tag-after" 150 $PY bench/decode.py --model "$m" --backends vulkan --repeats 3
    done ;;
  moe)  # mixture of experts: the MoE kernel tests on the GPU (the model made meanwhile, in the background), then
    # qwen3-30b-a3b Q4_K_M (18.6 GB); MOE_MATVEC=0 skips the per-pair matvec A/B
    if [ "${SMALL:-0}" = 1 ]; then MOE=tiny-qwen3moe; else MOE=qwen3-30b-a3b; fi
    MF=/tmp/m/$MOE-Q4_K_M.gguf
    [ -f $MF ] || { $PY -m trio_llm make-model --preset $MOE --quant Q4_K_M -o $MF -q > "$RES/make-moe.log" 2>&1 &
                    MKM=$!; }
    stage verify-moe 150 env TRIO_LLM_COOPMAT=0 $PY -m pytest -q -p no:cacheprovider -rs ${XD[@]+"${XD[@]}"} \
      tests/test_vulkan_moe.py tests/test_moe.py -k "not cm"
    stage verify-moe-cm 120 $PY -m pytest -q -p no:cacheprovider -rs tests/test_vulkan_moe.py -k cm
    [ -n "${MKM:-}" ] && { wait $MKM; say "make-moe rc=$?"; }
    stage decode-moe-q4km 300 $PY bench/decode.py --model $MF --backends vulkan --repeats 3 \
      --moe-prefill --moe-prefill-sizes 16,32,64,128,256,512
    # the whole pp512 with one moe_matvec per (token, expert) pair instead of the grouped, tiled experts
    [ "${MOE_MATVEC:-1}" = 1 ] && stage decode-moe-q4km-matvec 300 env TRIO_LLM_MOE_MATMUL=0 $PY bench/decode.py \
      --model $MF --backends vulkan --repeats 2 --tg 16
    if [ "${MOE35:-0}" = 1 ]; then  # MOE35=1: qwen35-35b-a3b's (256 experts) too, the file cpumoe makes
      if [ "${SMALL:-0}" = 1 ]; then M35=tiny-qwen35moe; else M35=qwen35-35b-a3b; fi
      [ -f /tmp/m/$M35-Q4_K_M.gguf ] || stage make-moe35 480 $PY -m trio_llm make-model --preset $M35 \
        --quant Q4_K_M -o /tmp/m/$M35-Q4_K_M.gguf -q
      stage decode-moe35-pp 300 $PY bench/decode.py --model /tmp/m/$M35-Q4_K_M.gguf --backends vulkan \
        --repeats 2 --tg 16 --moe-prefill --moe-prefill-sizes 32,64,128,256,512
    fi ;;
  glm)  # deepseek2 (GLM-4.7-Flash's multi-head latent attention): the latent kernels' GPU tests (attn_decode and
    # attn_prefill LATENT against numpy), then the glm-4.7-flash shape at Q4_K_M (about 17 GB, made meanwhile):
    # backend pp512 / tg128, then through HTTP at 512 and 8192 beside llama-server Vulkan (and CUDA once built)
    if [ "${SMALL:-0}" = 1 ]; then GLM=tiny-deepseek2; GP=64,256; else GLM=glm-4.7-flash; GP=512,8192; fi
    GF=/tmp/m/$GLM-Q4_K_M.gguf
    [ -f $GF ] || { $PY -m trio_llm make-model --preset $GLM --quant Q4_K_M -o $GF -q > "$RES/make-glm.log" 2>&1 &
                    MKG=$!; }
    stage verify-glm 150 $PY -m pytest -q -p no:cacheprovider -rs ${XD[@]+"${XD[@]}"} tests/test_deepseek2.py \
      tests/test_vulkan_kv.py tests/test_vulkan_attn_prefill.py -k "latent or deepseek"
    [ -n "${MKG:-}" ] && { wait $MKG; say "make-glm rc=$?"; }
    stage decode-glm 240 $PY bench/decode.py --model $GF --backends vulkan --repeats 2 --pp 512 --tg 128
    if [ -f .lcpp/h200.sh ]; then
      VK=$(bash .lcpp/h200.sh vulkan 2> "$RES/lcpp-vulkan.log" | tail -n 1)
      LL=(); [ -n "$VK" ] && [ -x "$VK" ] && LL=(--llama-vulkan "$VK")
      [ $CUDA_BUILD = 1 ] && LL+=(--llama-cuda $LCPP/cuda/bin/llama-server --wait-for $LCPP/cuda.done)
      left=$(( ${E2E_END:-565} - $(elapsed) ))
      [ $left -ge 60 ] && stage e2e-glm $((left + 15)) $PY bench/e2e.py --backend vulkan --model $GF --prompts $GP \
        ${LL[@]+"${LL[@]}"} --budget-s "$left" --reserve-s 15 --log-dir "$RES/e2e-glm-logs" --note "glm-4.7-flash shape"
      stop_build
    fi ;;
  vision)  # gemma-3 with an image (--mmproj): the CPU encoder alone on the host's cores (bench/vision.py), then one
    # image request through HTTP beside llama-server Vulkan (and CUDA once built), gemma3-4b Q4_K_M and a full-size
    # random gemma-3 projector (f16); SMALL=1: tiny-gemma3 and a 64-pixel projector on lavapipe
    if [ "${SMALL:-0}" = 1 ]; then VT=$(model tiny-gemma3 Q8_0); VSIZE=64; export GGML_VK_VISIBLE_DEVICES=0
      VARGS="image_size=64, patch_size=8, n_embd=64, n_ff=128, n_head=4, n_layer=2, n_merge=2"
    else wait $MG3 2>/dev/null; VT=/tmp/m/gemma3-4b-Q4_K_M.gguf; VSIZE=896
      VARGS="image_size=896, patch_size=14, n_embd=1152, n_ff=4304, n_head=16, n_layer=27, n_merge=4"; fi
    VM=/tmp/m/mmproj-$(basename $VT .gguf)-f16.gguf
    [ -f $VM ] || $PY -c "import sys; from trio_llm.model.gguf import load_gguf; from trio_llm.vision.synth import \
write_mmproj; write_mmproj(sys.argv[2], n_embd_text=load_gguf(sys.argv[1]).config.n_embd, wtype='f16', $VARGS)" \
      $VT $VM > "$RES/make-mmproj.log" 2>&1
    [ "${SMALL:-0}" = 1 ] || stage vision-encode 200 $PY bench/vision.py --repeats 2
    LL=()
    if [ -f .lcpp/h200.sh ]; then
      VK=$(bash .lcpp/h200.sh vulkan 2> "$RES/lcpp-vulkan.log" | tail -n 1)
      [ -n "$VK" ] && [ -x "$VK" ] && LL=(--llama-vulkan "$VK")
      if [ $CUDA_BUILD = 1 ]; then
        while [ ! -f $LCPP/cuda.done ] && [ $(elapsed) -lt ${E2E_END:-565} ]; do sleep 5; done
        [ "$(cat $LCPP/cuda.done 2>/dev/null)" = 0 ] && LL+=(--llama-cuda $LCPP/cuda/bin/llama-server)
      fi
    fi
    stage e2e-vision 300 $PY bench/e2e_vision.py --model $VT --mmproj $VM --image-size $VSIZE --repeats 2 \
      --backend vulkan ${LL[@]+"${LL[@]}"} --log-dir "$RES/e2e-vision-logs"
    stop_build ;;
  cpumoe)  # qwen35-35b-a3b Q4_K_M (21 GB) with --n-cpu-moe 0, 10, 10.5, 20: decode cost per host-resident layer
    if [ "${SMALL:-0}" = 1 ]; then MOE=tiny-qwen35moe; NS="0 1 1.5"; else MOE=qwen35-35b-a3b; NS="0 10 10.5 20"; fi
    [ -f /tmp/m/$MOE-Q4_K_M.gguf ] || stage make-moe35 480 $PY -m trio_llm make-model --preset $MOE --quant Q4_K_M \
      -o /tmp/m/$MOE-Q4_K_M.gguf -q
    for n in $NS; do
      stage "decode-moe35-ncmoe$n" 240 $PY bench/decode.py --model /tmp/m/$MOE-Q4_K_M.gguf --backends vulkan \
        --repeats 2 --n-cpu-moe $n
    done ;;
  hybrid)  # gated delta-net hybrids: the kernels on the GPU, then prefill/decode with the pp512 graph's parts
    stage verify-hybrid 240 $PY -m pytest -q -p no:cacheprovider tests/test_vulkan_deltanet.py tests/test_qwen35.py
    if [ "${SMALL:-0}" = 1 ]; then H1=tiny-qwen35; H9=tiny-qwen35; else H1=qwen35-0.8b; H9=qwen35-9b; fi
    for q in Q8_0 Q4_K_M; do
      stage "decode-q35-08b-$q" 240 $PY bench/decode.py --model "$(model $H1 $q)" --backends vulkan --repeats 3 \
        --prefill-breakdown
    done
    stage decode-q35-9b-q4km 400 $PY bench/decode.py --model "$(model $H9 Q4_K_M)" --backends vulkan --repeats 2 \
      --prefill-breakdown ;;
  hybfuse)  # the hybrid and MoE fusions (TRIO_LLM_HYBRID_FUSE, on by default) A/B: their tests on the GPU, then
    # decode of qwen35-0.8b Q8_0 and qwen35-35b-a3b Q4_K_M unfused (0) and fused (1), the graph without
    # barriers and per kernel (--breakdown: how much of a step the barriers still cost)
    stage verify-hybfuse 200 $PY -m pytest -q -p no:cacheprovider tests/test_vulkan_hybfuse.py \
      tests/test_vulkan_deltanet.py
    if [ "${SMALL:-0}" = 1 ]; then H1=tiny-qwen35; M35=tiny-qwen35moe; else H1=qwen35-0.8b; M35=qwen35-35b-a3b; fi
    HM=("$(model $H1 Q8_0):q35-08b-q8")
    if [ "${HYB35:-1}" = 1 ]; then  # HYB35=0: the 0.8b only (making the 35b-a3b file takes about 85 s)
      [ -f /tmp/m/$M35-Q4_K_M.gguf ] || stage make-moe35 300 $PY -m trio_llm make-model --preset $M35 \
        --quant Q4_K_M -o /tmp/m/$M35-Q4_K_M.gguf -q
      HM+=("/tmp/m/$M35-Q4_K_M.gguf:q35-35b-q4km")
    fi
    # then =1 with the larger groups off (TRIO_LLM_HYBRID_OFF: their parts fuse instead, the conv split and
    # the gated norm around a delta rule that reads q/k/v, the experts' down product apart from the combine,
    # the attention's gate a swiglu): which of the larger fusions pay
    for mq in "${HM[@]}"; do
      m=${mq%%:*}; tag=${mq##*:}
      for f in 0 1; do
        stage "decode-$tag-hybfuse$f" 150 env TRIO_LLM_HYBRID_FUSE=$f $PY bench/decode.py --model "$m" \
          --backends vulkan --repeats 2 --breakdown
      done
      stage "decode-$tag-hybfuse1-smaller" 120 env TRIO_LLM_HYBRID_OFF=delta_conv,moe_down_out,attn_gate \
        $PY bench/decode.py --model "$m" --backends vulkan --repeats 2
    done ;;
  decodeg3)  # gemma3-4b Q4_K_M (sliding-window layers), made in the background meanwhile
    wait $MG3 2>/dev/null
    stage decode-gemma3-4b-q4km 200 $PY bench/decode.py --model /tmp/m/gemma3-4b-Q4_K_M.gguf --backends vulkan \
      --repeats 3 ;;
  qtypes)  # llama-1b in the mixes the newer weight types carry, then the Q3_K / Q5_K wide
    # matvec loops against the generic loop they replaced (TRIO_LLM_MATVEC_GENERIC=1)
    for q in ${QTYPES_MIXES:-Q3_K_M Q5_K_M Q4_K_XL IQ4_XS}; do
      stage "decode-1b-$q" 100 $PY bench/decode.py --model "$(model $B1 $q)" --backends vulkan --repeats 2
    done
    for q in Q3_K_M Q5_K_M; do
      stage "decode-1b-$q-generic" 100 env TRIO_LLM_MATVEC_GENERIC=1 $PY bench/decode.py \
        --model "$(model $B1 $q)" --backends vulkan --repeats 2
    done ;;
  batch)  # batched decode's scaling alone (tunedec's last stages): B = 1, 2, 4, 8 sequences per step
    stage tune-batch-1b 120 $PY bench/decode.py --model "$M1" --backends vulkan --pp 64 --tg 64 --repeats 2 \
      --batch-sizes 1,2,4,8
    wait8b
    stage tune-batch-8b 150 $PY bench/decode.py --model "$M8B" --backends vulkan --pp 64 --tg 64 --repeats 2 \
      --batch-sizes 1,2,4,8 ;;
  mvq8)  # decode matvecs on int8 activations (TRIO_LLM_MATVEC_Q8=1, off by default): their tests on the GPU
    # (its integer dot products and the plain int fallback) and device sampling / the slots loop with it on,
    # then the batch stage's B = 1, 2, 4, 8 beside the default (one-column steps keep f32: TRIO_LLM_MATVEC_Q8_MIN=2)
    stage verify-mvq8 200 env TRIO_LLM_MATVEC_Q8=1 $PY -m pytest -q -p no:cacheprovider -rs tests/test_vulkan_mvq8.py \
      tests/test_devsample.py tests/test_server_decode.py
    for q8 in 0 1; do
      stage "tune-batch-1b-mvq8-$q8" 120 env TRIO_LLM_MATVEC_Q8=$q8 $PY bench/decode.py --model "$M1" --backends vulkan \
        --pp 64 --tg 64 --repeats 2 --batch-sizes 1,2,4,8
    done
    wait8b
    for q8 in 0 1; do
      stage "tune-batch-8b-mvq8-$q8" 150 env TRIO_LLM_MATVEC_Q8=$q8 $PY bench/decode.py --model "$M8B" --backends vulkan \
        --pp 64 --tg 64 --repeats 2 --batch-sizes 1,2,4,8
    done ;;
  decode1b)  # llama-1b Q4_K_M only
    stage decode-1b-q4km 100 $PY bench/decode.py --model "$(model $B1 Q4_K_M)" --backends vulkan --repeats 3 ;;
  vkmem)
    stage vkmem 120 $PY bench/vkmem.py --repeats 3
    # the same allocation and free through CUDA (cupy), for comparison
    stage cudamem 60 $PY -c '
import time, cupy
rt, n = cupy.cuda.runtime, 1280 << 20
for i in range(4):
    t0 = time.perf_counter(); p = rt.malloc(n); rt.deviceSynchronize(); t1 = time.perf_counter()
    rt.memset(p, 0, n); rt.deviceSynchronize(); t2 = time.perf_counter()
    rt.free(p); rt.deviceSynchronize(); t3 = time.perf_counter()
    print(f"cuda 1280 MiB: malloc {1e3*(t1-t0):.2f} ms, memset {1e3*(t2-t1):.2f} ms, free {1e3*(t3-t2):.2f} ms")
' ;;
  residency)
    wait8b
    stage residency-1b 60 $PY bench/residency.py --model "$M1" --backend vulkan --repeats 5
    stage residency-8b 80 $PY bench/residency.py --model "$M8B" --backend vulkan --repeats 3 ;;
  handoff)  # issue 16's back-to-back alternation targets: llama-1b Q8_0 <= 49 ms, llama-8b Q4_K_M <= 138 ms
    stage handoff-1b-weights 90 $PY bench/handoff.py --model "$M1" --backend vulkan --handoffs 60 --sleep-mode weights
    wait8b
    stage handoff-8b-weights 150 $PY bench/handoff.py --model "$M8B" --backend vulkan --handoffs 30 --sleep-mode weights ;;
  coldmem)  # issue 12: hybrid (and MoE) models resident and after POST /sleep?level=all through trio-llm serve,
    # the backend's bytes and the driver's per-process counter, the same answer and cache_n > 0 after the wake
    CM=("$(model qwen35-0.8b Q4_K_M)"); [ "${COLDMEM_9B:-1}" = 1 ] && CM+=("$(model qwen35-9b Q4_K_M)"); CM+=("$M1")
    [ -f /tmp/m/qwen35-35b-a3b-Q4_K_M.gguf ] && CM+=(/tmp/m/qwen35-35b-a3b-Q4_K_M.gguf)
    MA=(); for m in "${CM[@]}"; do MA+=(--model "$m"); done
    stage coldmem 240 $PY bench/coldmem.py "${MA[@]}" --backend vulkan --log-dir "$RES/coldmem-logs" ;;
  pipemem)  # issue 12: which pipelines hold a released model's driver memory (bench/pipemem.py: the counter
    # with the device open, loaded, run, released, then after each pipeline's destruction)
    PM=("$(model qwen35-0.8b Q4_K_M)" "$M1")
    PA=(); for m in "${PM[@]}"; do PA+=(--model "$m"); done
    stage pipemem 150 env TRIO_LLM_PIPELINE_STATS=1 $PY bench/pipemem.py "${PA[@]}"
    [ "${PIPEMEM_AB:-1}" = 1 ] || continue
    # delta_net.comp's split-lane form (TRIO_LLM_DELTA_SPLIT: lanes per state column), decode and pp512
    for dp in 0 2 4 8; do
      stage "pipemem-decode-split$dp" 90 env TRIO_LLM_DELTA_SPLIT=$dp $PY bench/decode.py --model "${PM[0]}" \
        --backends vulkan --pp 512 --tg 128 --repeats 2
    done
    Q9=$(model qwen35-9b Q4_K_M)
    for dp in 0 4; do
      stage "pipemem-decode-9b-split$dp" 90 env TRIO_LLM_DELTA_SPLIT=$dp $PY bench/decode.py --model "$Q9" \
        --backends vulkan --pp 512 --tg 128 --repeats 2
    done ;;
  verifydelta)  # the delta rule's forms on the GPU (carry .cc: the tests' head dims compile there): the op tests of
    # every form (loops, DP 2/4/8, fused), the qwen35 model tests (DP 4 is the default since 2026-12-01 night)
    stage verify-delta 240 $PY -m pytest -q -p no:cacheprovider -rs tests/test_vulkan_deltanet.py tests/test_qwen35.py \
      tests/test_vulkan_hybfuse.py -k "delta or vulkan" ;;
  coldmem2)  # issue 12's cold memory taken apart through the server: qwen35-0.8b without context checkpoints
    stage coldmem-nockpt 120 $PY bench/coldmem.py --model "$(model qwen35-0.8b Q4_K_M)" --backend vulkan \
      --arg=--ctx-checkpoints --arg=0 --log-dir "$RES/coldmem2-logs" ;;
  sample)  # the device sampling tests alone (also in verify)
    stage verify-sample 150 $PY -m pytest -q -p no:cacheprovider tests/test_devsample.py tests/test_server_decode.py ;;
  serverpath)  # issue 14: the backend's own decode beside /completion on the same file, per-token breakdown;
    # TRIO_LLM_DECODE_STEPS 0 (logits read back, host sampling: the old path), 1 and 4 (device sampling)
    for st in ${SP_STEPS:-0 1 4}; do
      stage "serverpath-1b-steps$st" 120 env TRIO_LLM_DECODE_STEPS=$st $PY bench/serverpath.py --model "$M1" \
        --backend vulkan --repeats 3 --steps 1,4
    done
    stage serverpath-1b-sampled 120 $PY bench/serverpath.py --model "$M1" --backend vulkan --repeats 3 --sampled
    wait8b
    for st in 0 4; do
      stage "serverpath-8b-steps$st" 150 env TRIO_LLM_DECODE_STEPS=$st $PY bench/serverpath.py --model "$M8B" \
        --backend vulkan --repeats 3 --steps 1,4
    done ;;
  coresident)  # issue 16: a co-resident pair's request latency (--arena-budget auto), to compare with warm;
    # then the co-residency scenarios on the GPU (their budgets are sized for the tiny model: no --model)
    stage coresident-1b 90 $PY bench/handoff.py --model "$M1" --backend vulkan --handoffs 60 --sleep-mode weights \
      --arena-budget auto
    for sc in coresident pinned fork-joins; do
      stage "scenario-$sc-tiny" 120 $PY -m trio_llm scenario run "$sc" --full --backend vulkan --reference replay \
        --out "$RES/scenario-$sc-tiny" -q
    done ;;
  server)
    stage server-1b 90 $PY bench/server.py --model $B1:Q8_0 --backend vulkan --clients 4 --repeats 2 ;;
  scen1b)  # SCEN1B="alternating" to run fewer
    for sc in ${SCEN1B:-alternating three-way quantum}; do
      stage "scenario-$sc-1b" 120 $PY -m trio_llm scenario run "$sc" --full --backend vulkan --reference replay \
        --model "$M1" --out "$RES/scenario-$sc-1b" -q
    done ;;
  scen8b)
    wait8b
    for sc in alternating three-way; do
      stage "scenario-$sc-8b" 120 $PY -m trio_llm scenario run "$sc" --length "${L8:-12}" --backend vulkan --reference replay \
        --model "$M8B" --out "$RES/scenario-$sc-8b" -q
    done ;;
  lcppops)  # issue 13: llama.cpp's own per-op GPU times (ggml-vulkan's GGML_VK_PERF_LOGGER) on the prebuilt Vulkan
    # llama-server, llama-1b Q8_0 at 32k and llama-8b Q4_K_M at 4k (bench/lcpp_ops.py): its flash attention and matrix
    # products beside ours (bench/prefill.py, bench/matmul.py) say which kernel is behind and by how much. Needs .lcpp
    [ -f .lcpp/h200.sh ] || { say "lcppops: no .lcpp/ carried"; continue; }
    VK=$(bash .lcpp/h200.sh vulkan 2> "$RES/lcpp-vulkan.log" | tail -n 1)
    stage lcppops-1b-32k 120 $PY bench/lcpp_ops.py --llama-vulkan "$VK" -m "$M1" --prompt ${LCPP_OPS_1B:-32768} \
      --log-dir "$RES/lcppops-logs"
    wait8b
    stage lcppops-8b-4k 120 $PY bench/lcpp_ops.py --llama-vulkan "$VK" -m "$M8B" --prompt ${LCPP_OPS_8B:-4096} \
      --log-dir "$RES/lcppops-logs" ;;
  e2e)  # end to end through HTTP (bench/e2e.py), one record; trio-llm first, while CUDA builds
    [ -f .lcpp/h200.sh ] || { say "e2e: no .lcpp/ carried (bash ../shared/tools/llamacpp/prepare.sh here)"; continue; }
    VK=$(bash .lcpp/h200.sh vulkan 2> "$RES/lcpp-vulkan.log" | tail -n 1)
    LL=(); [ -n "$VK" ] && [ -x "$VK" ] && LL=(--llama-vulkan "$VK")
    NOTE=""
    if [ $CUDA_BUILD = 1 ]; then
      LL+=(--llama-cuda $LCPP/cuda/bin/llama-server --wait-for $LCPP/cuda.done)
      NOTE="trio-llm and llama-server Vulkan measured while llama.cpp CUDA built at nice 19"
    fi
    K1=${E2E_K1:-0}; K8=${E2E_K8:-0}  # e.g. E2E_K1=8 E2E_K8=4: concurrent clients, -np K
    if [ "${SMALL:-0}" = 1 ]; then P1=64,256; P8=64,256; export GGML_VK_VISIBLE_DEVICES=0  # lavapipe
    else P1=128,512,8192,32768; P8=128,512,16384; fi  # 128: issue 14's time to first token of a 128-token prompt
    wait8b  # its making (all cores) would disturb our server's figures; the build runs at nice 19
    left=$(( ${E2E_END:-565} - $(elapsed) ))  # seconds of the 10-minute device call left for it
    if [ $left -lt 60 ]; then say "e2e: only $left s left, not started"; stop_build; continue; fi
    M8ARGS=(--model "$M8B" --prompts "${E2E_P8:-$P8}" --clients "$K8")
    [ "${NO8B:-0}" = 1 ] && M8ARGS=()  # NO8B=1: llama-1b's rows only
    stage e2e $((left + 15)) $PY bench/e2e.py --backend vulkan \
      --model "$M1" --prompts "${E2E_P1:-$P1}" --clients "$K1" \
      ${M8ARGS[@]+"${M8ARGS[@]}"} ${LL[@]+"${LL[@]}"} \
      --budget-s "$left" --reserve-s 15 --ttft-max 8192 --log-dir "$RES/e2e-logs" ${E2E_ARGS:-} --note "$NOTE"
    stop_build
    for f in $LCPP/cuda-cmake.log $LCPP/cuda-build.log; do [ -f "$f" ] && tail -n 40 "$f" > "$RES/lcpp-$(basename "$f")"; done
    [ -f $LCPP/cuda.done ] && say "CUDA build rc=$(cat $LCPP/cuda.done)"
    pack ;;
  mem128k)  # issue 13 item 5: device memory (nvidia-smi, per process) at -c 131072 with a q8_0 K and V cache,
    # trio-llm beside llama-server CUDA, llama-8b Q4_K_M and llama-1b Q8_0 (after e2e, or waiting for the build)
    [ -f .lcpp/h200.sh ] || { say "mem128k: no .lcpp/ carried"; continue; }
    wait8b
    Q8=(--trio-arg=-ctk --trio-arg=q8_0 --trio-arg=-ctv --trio-arg=q8_0
        --llama-arg=-ctk --llama-arg=q8_0 --llama-arg=-ctv --llama-arg=q8_0)
    stage mem128k 420 $PY bench/e2e.py --backend vulkan --mem-only -m "$M8B" --prompts 130880 -m "$M1" \
      --prompts 130880 "${Q8[@]}" --llama-cuda $LCPP/cuda/bin/llama-server --wait-for $LCPP/cuda.done \
      --log-dir "$RES/mem128k-logs" --note "-c 131072, q8_0 K and V"
    stop_build ;;
  serve128k)  # issue 13's "128k prompts served": one 130,880-token prompt (+128 generated) at -c 131072 with a q8_0
    # K/V cache, llama-1b Q8_0 then llama-8b Q4_K_M, trio-llm beside llama-server CUDA, no warm-up, no stream;
    # each row also records the device memory the server then holds (about 7 minutes in all: trio-llm's rows took
    # 391 s on 2026-12-01, so E2E_ARGS=--no-trio gives llama-server CUDA's rows a call of their own)
    [ -f .lcpp/h200.sh ] || { say "serve128k: no .lcpp/ carried"; continue; }
    wait8b
    Q8=(--trio-arg=-ctk --trio-arg=q8_0 --trio-arg=-ctv --trio-arg=q8_0
        --llama-arg=-ctk --llama-arg=q8_0 --llama-arg=-ctv --llama-arg=q8_0)
    left=$(( ${E2E_END:-565} - $(elapsed) ))
    stage serve128k $((left + 15)) $PY bench/e2e.py --backend vulkan -m "$M1" --prompts 130880 -m "$M8B" \
      --prompts 130880 "${Q8[@]}" --repeats 1 --warmups 0 --ttft-max 1 --llama-cuda $LCPP/cuda/bin/llama-server \
      --wait-for $LCPP/cuda.done --budget-s "$left" --reserve-s 15 --log-dir "$RES/serve128k-logs" ${E2E_ARGS:-} \
      --note "-c 131072, q8_0 K and V, one request per row"
    stop_build ;;
  e2emoe)  # the hybrid and MoE models end to end through HTTP beside llama-server CUDA (and Vulkan)
    [ -f .lcpp/h200.sh ] || { say "e2emoe: no .lcpp/ carried"; continue; }
    if [ "${SMALL:-0}" = 1 ]; then MS="tiny-qwen35 tiny-qwen3moe"; export GGML_VK_VISIBLE_DEVICES=0
    else MS=${E2E_MOE:-qwen35-0.8b qwen3-30b-a3b qwen35-35b-a3b}; fi
    VK=$(bash .lcpp/h200.sh vulkan 2> "$RES/lcpp-vulkan.log" | tail -n 1)
    LL=(); [ -n "$VK" ] && [ -x "$VK" ] && LL=(--llama-vulkan "$VK")
    [ $CUDA_BUILD = 1 ] && LL+=(--llama-cuda $LCPP/cuda/bin/llama-server --wait-for $LCPP/cuda.done)
    MA=()
    for mp in $MS; do
      [ -f /tmp/m/$mp-Q4_K_M.gguf ] || stage "make-$mp" 300 $PY -m trio_llm make-model --preset $mp --quant Q4_K_M \
        -o /tmp/m/$mp-Q4_K_M.gguf -q  # (cpumoe, run before, makes qwen35-35b-a3b's)
      MA+=(--model /tmp/m/$mp-Q4_K_M.gguf --prompts "${E2E_MOE_P:-512,4096}" --clients 0)
    done
    left=$(( ${E2E_END:-565} - $(elapsed) ))
    if [ $left -lt 60 ]; then say "e2emoe: only $left s left, not started"; stop_build; continue; fi
    stage e2emoe $((left + 15)) $PY bench/e2e.py --backend vulkan "${MA[@]}" ${LL[@]+"${LL[@]}"} \
      --budget-s "$left" --reserve-s 15 --ttft-max 512 --log-dir "$RES/e2emoe-logs" ${E2E_ARGS:-} \
      --note "hybrid and MoE models; trio-llm measured while llama.cpp CUDA built at nice 19"
    stop_build
    [ -f $LCPP/cuda.done ] && say "CUDA build rc=$(cat $LCPP/cuda.done)"
    pack ;;
esac; done
pack
say "done"
