export PYTHONPATH=src
timeout 150 python -m pytest -q -x -p no:benchmark tests/test_gpu.py -k "hopper_gluon" 2>&1 | tail -3
echo NEW; timeout 200 python -m tripath.bench.kernels --only prefill mixed 2>&1 | grep "tripath varlen\|three_path (nhd)\|SDPA"
echo OLD; PYTHONPATH=scratch_old/src timeout 100 python -m tripath.bench.kernels --only mixed 2>&1 | grep "three_path (nhd)"
