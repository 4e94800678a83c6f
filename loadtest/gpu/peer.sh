# Part `peer` of loadtest/gpu.sh: the transformers peer (loadtest/hf_peer_bench.py) on one
# GPU, single-stream latency and fixed 1024/128 throughput, next to `meshserve bench` on the
# same workloads in the same call; the suite's table (summary.md) ends with the ratios. The
# suite's files and knobs (loadtest/gpu/suite.sh: HF_PROMPTS, HF_BATCH_SIZES, HF_FLAGS,
# LATENCY_LEN, SHORT_IN, SHORT_OUT, T_HF_LATENCY, T_HF_THROUGHPUT, ...).
SUITE_SECTIONS=peer
# shellcheck source=loadtest/gpu/suite.sh
. loadtest/gpu/suite.sh
