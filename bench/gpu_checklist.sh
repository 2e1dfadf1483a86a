#!/usr/bin/env bash
# shared/GPU-CHECKLIST.md as one command for a lent GPU machine (the device tool), which has no network:
# the wheels tessera needs beyond the machine's own torch travel in .whl/ (see docs/benchmarks.md, "On a GPU").
# Each step has its own time limit so one that hangs cannot eat the others' time; logs go to $OUT.
set -u
OUT=${OUT:-/tmp/tessera-gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, composer, streaming, transformers; print('torch', torch.__version__, 'composer', composer.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"
python3 -c "import trainers.build, evaluation.runner" 2>&1 | tail -4
echo "== 1. pytest -m gpu"
timeout "${GPU_TESTS_S:-240}" python3 -m pytest -m gpu -q -p no:cacheprovider --noconftest tests/test_gpu.py 2>&1 \
  | tee "$OUT/gpu-tests.log" | grep -E "passed|failed|Error|error|assert" | tail -12
echo "== 2. bench/mfu.py (tessera's trainer against a plain compiled loop, same process)"
timeout "${MFU_S:-300}" python3 bench/mfu.py --presets ${MFU_PRESETS:-125m 350m 1b} --steps "${MFU_STEPS:-8}" --warmup 3 \
  > "$OUT/mfu.log" 2>&1
echo "rc=$?"; grep -E "^(125m|350m|1b) " "$OUT/mfu.log"; tail -c 1500 "$OUT/mfu.log"
echo "== 3. a relaunch's time to its first step, cold and warm compile cache (350M)"
timeout "${RESUME_S:-240}" python3 bench/resume.py --compile --preset 350m --seq-len 2048 --batch 16 --repeats 1 \
  > "$OUT/resume-compile.log" 2>&1
echo "rc=$?"; tail -c 800 "$OUT/resume-compile.log"
echo "== 3b. bench/loss_memory.py (350M, microbatch 16 x 2048: the fused loss against transformers')"
timeout "${LOSSMEM_S:-180}" python3 bench/loss_memory.py > "$OUT/loss-memory.log" 2>&1
echo "rc=$?"; tail -c 800 "$OUT/loss-memory.log"
echo "== 4. bench/checkpoint_time.py"
timeout "${CKPT_S:-240}" python3 bench/checkpoint_time.py > "$OUT/checkpoint_time.log" 2>&1
echo "rc=$?"; tail -c 1500 "$OUT/checkpoint_time.log"
