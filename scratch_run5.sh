export PYTHONPATH=src
timeout 150 python -m pytest -m gpu -q -x -n 8 -p no:benchmark tests --deselect tests/test_engine.py::test_cuda_graphs_memory_and_fp8_on_gpu 2>&1 | tail -3
timeout 200 python -m tripath.bench.kernels --only prefill mla --out $OUT/bench5.md > $OUT/bench5.log 2>&1; tail -2 $OUT/bench5.log
grep "tripath varlen\|SDPA\|mla (CUDA\|mla_triton (CUDA" $OUT/bench5.md
timeout 60 python -m tripath.bench.kernels --only mixed 2>&1 | grep "three_path (nhd)\|overlapped (nhd), CUDA"
