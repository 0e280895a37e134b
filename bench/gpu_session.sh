#!/usr/bin/env bash
# Everything the GPU machine has to show, in one call from the repository root (CuPy there; the
# wheels it lacks, nvmath-python among them, travel in .whl/: see README "GPU checks"). Logs go to
# $OUT when it is set.
set -u
OUT=${OUT:-/tmp/emberlink-gpu}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH
    chmod +x /tmp/site/bin/* 2>/dev/null
else
    export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import cupy, numpy, grpc; print('cupy', cupy.__version__, 'numpy', numpy.__version__, 'grpcio', grpc.__version__)"
python3 -c "import nvmath; print('nvmath-python', nvmath.__version__)" \
    || echo "nvmath-python missing: plans run eagerly, the captured rows and tests cannot run"

echo "== 1. GPU tests: every op on CuPy against the NumPy reference, fused chains, captured graphs, Device.cuda"
timeout ${EMBERLINK_GPU_TEST_S:-240} python3 -m pytest -q -m gpu -p no:cacheprovider tests >"$OUT/gpu_tests.log" 2>&1
echo "pytest exit $?"; tail -5 "$OUT/gpu_tests.log"

echo "== 2. the README's example on Device.cuda(0)"
python3 examples/train_mlp.py --device cuda:0 --epochs 3 2>&1 | tee "$OUT/example_cuda.log" | tail -5

echo "== 3. emberlink worker --device cuda:0 serving a client on loopback"
tmp=$(mktemp -d)
python3 -m emberlink keygen --out "$tmp/client.key" >"$tmp/allow"
python3 -m emberlink keygen --out "$tmp/worker.key" >/dev/null
python3 -m emberlink worker --listen 127.0.0.1:0 --key "$tmp/worker.key" --allow "$tmp/allow" \
    --device cuda:0 >"$tmp/ticket" 2>"$OUT/worker.log" &
worker=$!
for _ in $(seq 100); do [ -s "$tmp/ticket" ] && break; sleep 0.1; done
ticket=$(head -1 "$tmp/ticket"); echo "ticket: $ticket"
python3 -m emberlink ping "$ticket" --key "$tmp/client.key" --count 50
EMBERLINK_KEY="$tmp/client.key" python3 examples/train_mlp.py --device "$ticket" --epochs 3 2>&1 \
    | tee "$OUT/example_remote_cuda.log" | tail -5
kill -TERM $worker; wait $worker; echo "worker exit $?"; tail -3 "$OUT/worker.log"

echo "== 4. MLP steps: PyTorch, CuPy, Device.cuda(0) and a cuda:0 worker on loopback; where a remote step's time goes"
timeout 200 python3 bench/gpu_step.py 2>"$OUT/gpu_step.err" | tee "$OUT/gpu_step.md"
[ "${EMBERLINK_STEP_TRACE:-1}" = 1 ] && timeout 60 python3 bench/step_trace.py --transport tcp 2>"$OUT/step_trace.err" | tee "$OUT/step_trace.md"

echo "== 5. models on Device.cuda(0): the examples, the CNN memory bench, conv and attention against PyTorch"
timeout 60 python3 examples/cnn_digits.py --device cuda:0 2>&1 | tee "$OUT/cnn_digits.log" | tail -3
timeout 60 python3 examples/lora_finetune.py --device cuda:0 2>&1 | tee "$OUT/lora_finetune.log" | tail -8
timeout 60 python3 bench/cnn_memory.py --device cuda:0 2>&1 | tee "$OUT/cnn_memory.md" | tail -12
[ "${EMBERLINK_GPU_MODELS:-1}" = 1 ] && timeout 120 python3 bench/gpu_models.py --deadline 85 --steps 25 2>"$OUT/gpu_models.err" | tee "$OUT/gpu_models.md"

# EMBERLINK_HOST_BENCHES=1 runs them all; a list of names (e.g. "remote_step local_step") runs those.
benches=${EMBERLINK_HOST_BENCHES:-0}
[ "$benches" = 1 ] && benches="local_step protocol remote_step replay relay"
if [ "$benches" != 0 ]; then
    echo "== 6. the CPU benchmarks on this (quieter, 16-core) host"
    for b in $benches; do
        echo "-- bench/$b.py"
        timeout 240 python3 bench/$b.py >"$OUT/bench_$b.md" 2>"$OUT/bench_$b.err"; echo "exit $?"
        grep -v '^I[0-9]' "$OUT/bench_$b.md" | tail -25
    done
fi
