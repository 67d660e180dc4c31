export PYTHONPATH=src
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 200 python -m pytest -m gpu -q -n 8 -p no:benchmark tests --deselect tests/test_engine.py::test_cuda_graphs_memory_and_fp8_on_gpu 2>&1 | tail -4
timeout 120 python -m pytest -m gpu -q -p no:benchmark tests/test_engine.py::test_cuda_graphs_memory_and_fp8_on_gpu 2>&1 | tail -2
timeout 300 python -m tripath.bench.kernels --repeat 3 --out $OUT/bench.md > $OUT/bench.log 2>&1; tail -3 $OUT/bench.log
grep "tripath varlen\|three_path (nhd)\|SDPA\|unified (nhd)\|two_path (nhd)" $OUT/bench.md
