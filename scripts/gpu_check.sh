#!/usr/bin/env bash
# The CUDA path, checked in one go (`make gpu-check`, at most 5 minutes on one GPU):
#  1. the losslessness matrix on tiny float64 models placed on the GPU: every proposer with
#     every lossless verifier gives standard greedy decoding's tokens, the sampled chains and
#     trees keep the target's distribution;
#  2. a short bench of the default model on the GPU (standard decoding, its A/A twin, two
#     pipelines, hf_generate), whose results.json records the GPU.
# Everything it prints and writes lands in $GPU_CHECK_OUT (default outputs/gpu-check).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
OUT=${GPU_CHECK_OUT:-outputs/gpu-check}
mkdir -p "$OUT"
if ! $PY -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then
    echo "gpu-check: this PyTorch ($($PY -c 'import torch; print(torch.__version__)')) sees no CUDA device;" \
         "install a CUDA build of torch on a machine with a GPU" >&2
    exit 2
fi
$PY -c "import torch; print('device:', torch.cuda.get_device_name(0), '| torch', torch.__version__)" | tee "$OUT/device.txt"

status=0
SPECDEC_TEST_DEVICE=cuda timeout 200 $PY -m pytest -q -x -p no:cacheprovider -n 0 \
    tests/decoders/engine/test_greedy_identity.py::test_greedy_output_equals_standard \
    tests/verifiers/test_rejection.py tests/verifiers/test_tree.py \
    2>&1 | tee "$OUT/lossless.log" | tail -5
[ "${PIPESTATUS[0]}" = 0 ] || status=1

timeout 90 $PY -m specdec.decoders.bench model.device=cuda workload.limit=1 bench.max_new_tokens=32 \
    bench.peers=[hf_generate] "bench.pipelines=[ngram,copy_heads]" bench.plots=false logger=disabled \
    bench.output="$(pwd)/$OUT/results.json" hydra.run.dir="$OUT/bench" \
    2>&1 | tee "$OUT/bench.log" | tail -25
[ "${PIPESTATUS[0]}" = 0 ] || status=1

echo "gpu-check: $([ $status = 0 ] && echo passed || echo FAILED) ($OUT)"
exit $status
