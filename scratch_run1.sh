set -x
export PYTHONPATH=src
nvidia-smi --query-gpu=name,clocks.sm --format=csv
timeout 240 python -m pytest -q -x -p no:benchmark tests/test_gpu.py -k "hopper_gluon or long_tiles" 2>&1 | tail -30
timeout 200 python -m tripath.bench.kernels --only prefill mixed --out $OUT/bench1.md 2>&1 | tail -40
