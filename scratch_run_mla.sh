# Next session, first GPU call for this branch:
export PYTHONPATH=src
timeout 200 python -m pytest -q -p no:benchmark tests/test_mla_ops.py -k gluon 2>&1 | tail -15
timeout 200 python -m tripath.bench.kernels --only mla 2>&1 | grep "mla_decode"
