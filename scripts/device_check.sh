#!/usr/bin/env bash
# One command for a lent GPU (issue 38), run from the repository root on the device machine; within 8 minutes:
#   1. installs the Python packages the device image lacks from wheels carried in .whl/ (if that folder is there);
#   2. runs the CUDA tests (CUDA_TESTS, default: tests/test_cuda_graphs.py and tests/test_triton*.py);
#   3. scripts/device_check.py: greedy equality of the triton backend against torch on three families, and the
#      table of dummy-weight Qwen2-0.5B / Llama-3-8B shapes in bf16 (batch-1 ms per token against the HBM
#      floor, tok/s at batch 64 and 256, CUDA graphs on and off, the torch backend beside it).
#
# The wheelhouse (here, where pip reaches the package index; .whl/ is ignored by git):
#   echo /.whl/ >> .git/info/exclude      # once
#   scripts/device_check.sh --wheels      # pip download of the WHEELS below into .whl/ (CPython 3.12, x86-64)
# On the device machine (the session's device tool), carrying that folder:
#   run(command="bash scripts/device_check.sh", carry=[".whl"], timeout_s=540)
# Results: the table on stdout, and $OUT/device_check.json (or /tmp/device_check.json) with every figure.
# Here, on a CPU: python scripts/device_check.py --dry-run (the same driver on the demo model, torch backend).
set -uo pipefail
cd "$(dirname "$0")/.."

# What the device image lacks (its package list: the device README's KINDS.md), at the versions tested here.
WHEELS=(fastapi==0.165.0 starlette==1.10.0 uvicorn==0.55.0 pydantic==2.13.4 pydantic_core==2.46.4
        annotated-types==0.7.0 typing-inspection==0.4.2 typing_extensions==4.16.0 opentelemetry-api==1.45.2
        llguidance==1.9.1 gguf==0.19.0)

if [[ "${1:-}" == "--wheels" ]]; then
    platforms=()
    for n in 17 24 27 28 31 34 35; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
    exec python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        "${platforms[@]}" --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "${WHEELS[@]}"
fi

start=$SECONDS
budget=${DEVICE_CHECK_BUDGET:-470}  # seconds for the whole command (8 minutes, with a margin)
out=${OUT:-/tmp}
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || { echo "device_check: installing .whl/ failed"; exit 3; }
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
python3 -c "import fastapi, uvicorn, llguidance, gguf, pagedllm" \
    || { echo "device_check: packages missing: build .whl/ (scripts/device_check.sh --wheels) and carry it"; exit 3; }
nvidia-smi -L || true
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda)"

echo "== CUDA tests"
tests=${CUDA_TESTS:-$(ls tests/test_cuda_graphs.py tests/test_triton*.py 2>/dev/null | tr '\n' ' ')}
# shellcheck disable=SC2086  # (a list of paths)
timeout 170 python3 -m pytest -q -p no:cacheprovider -x $tests 2>&1 | tail -25
tests_rc=${PIPESTATUS[0]}

echo "== measurements"
left=$((budget - (SECONDS - start)))
inner=$((left > 100 ? left - 70 : 30))  # the driver starts no configuration past this (one takes up to ~60 s)
timeout "$left" python3 scripts/device_check.py --time-budget "$inner" --json "$out/device_check.json" 2>&1 \
    | grep -v 'pagedllm: model='  # (each engine's long start-up line; the CUDA-graphs line stays)
check_rc=${PIPESTATUS[0]}
echo "device_check: tests rc=$tests_rc, measurements rc=$check_rc, $((SECONDS - start)) s"
exit $((tests_rc || check_rc))
