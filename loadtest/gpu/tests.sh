# Part `tests` of loadtest/gpu.sh: the GPU correctness tests, `pytest -q tests/gpu` (the
# Triton kernels compiled against the PyTorch references, the engine's GPU paths against its
# CPU path, fresh-prefill attention, structured outputs, TP=2 against TP=1 where two GPUs
# are). $OUT gets pytest.log and the tests' figures as JSON (GPU_TEST_OUT). Knobs:
# GPU_TESTS (the test files or folders, default tests/gpu), PYTEST_ARGS (more pytest
# arguments, e.g. "-x"), T_TESTS (900 s).
# shellcheck disable=SC2086  # GPU_TESTS and PYTEST_ARGS are lists of words
gpu_step pytest "${T_TESTS:-900}" env GPU_TEST_OUT="$OUT" python3 -m pytest -q \
  -p no:cacheprovider ${GPU_TESTS:-tests/gpu} ${PYTEST_ARGS:-}
grep -q "^== pytest: exit 0 " "$OUT/steps.log"  # the part fails where a test did
