# Part `kv` of loadtest/gpu.sh: the KV tier, routing and failover on one GPU, with the
# Llama-3.1-8B shape (dummy bf16 weights, a tokenizer of its vocabulary made by
# loadtest/make_tokenizer.py):
#
#     KV_PARTS="transfer load failover" bash loadtest/gpu.sh kv     # results in $OUT/kv
#     KV_PARTS="routing" bash loadtest/gpu.sh kv
#     KV_PARTS="routing" ROUTING_TAG=_nostore ROUTING_FLAGS=--no-kvstore bash loadtest/gpu.sh kv
#     KV_PARTS="routing" ROUTING_TAG=_rate30 \
#         ROUTING_ARGS="--concurrency 0 --request-rate 30" bash loadtest/gpu.sh kv
#
# ROUTING_ARGS go to kv_routing.py (e.g. "--policies kv-aware@64,round-robin"), ROUTING_FLAGS to the
# launcher; every service's /metrics after each run lands in $OUT/routing<tag>_metrics/.
#
# KV_PARTS (default all four; each a step under `timeout`, its output in $OUT/<name>.log
# and .json):
#   transfer   loadtest/kvstore_transfer.py: the store's same-host put/get GB/s (shared
#              memory and gRPC bytes) and host-to-device copy rates
#   load       loadtest/kv_tier_load.py: TTFT of an 8k-token prompt recomputed against
#              loaded from the kvstore, and the load rate
#   failover   loadtest/fault_matrix.py --parts worker: two workers sharing the GPU, one
#              killed under 20 streams; every stream must complete; time to resumed tokens
#   routing    loadtest/kv_routing.py: kv-aware against round-robin on prefix-heavy
#              requests, two workers sharing the GPU, the kvstore on

KV_PARTS=${KV_PARTS:-transfer load failover routing}
want() { [[ " $KV_PARTS " == *" $1 "* ]]; }

MODEL_DIR=${MODEL_DIR:-$PWD/loadtest/models/llama-3.1-8b}
MESH_MODEL=$RUN_DIR/mesh-model
STEP_TAIL=25  # lines of each step's log shown

if want routing || want failover; then
  gpu_step mesh_model 120 python3 loadtest/make_tokenizer.py --config "$MODEL_DIR/config.json" \
    --out "$MESH_MODEL"
fi
if want transfer; then
  gpu_step transfer 120 python3 loadtest/kvstore_transfer.py --capacity-bytes $((8 << 30)) \
    --out "$OUT/transfer.json"
fi
if want load; then
  gpu_step load 300 python3 loadtest/kv_tier_load.py --device cuda --prefix-len 8192 --iters 3 \
    --capacity-bytes $((8 << 30)) --out "$OUT/load.json"
fi
if want failover; then
  gpu_step failover 240 python3 loadtest/fault_matrix.py --model "$MESH_MODEL" --device cuda \
    --load-format dummy --max-model-len 4096 --parts worker --streams 20 --max-tokens 512 \
    ${FAILOVER_ARGS:-} \
    --out "$OUT/failover.json"
fi
if want routing; then
  # Two workers share the GPU (--device cuda: the launcher gives each 0.45 of it, 9192
  # blocks, 147k tokens); 128 tenants of 2048 tokens (262k tokens) are more than one
  # worker's cache holds and less than both do. 512 untimed requests first: the caches of a
  # server that has been up, not a cold start.
  gpu_step "routing${ROUTING_TAG:-}" "${ROUTING_LIMIT_S:-580}" python3 loadtest/kv_routing.py \
    --model "$MESH_MODEL" --num-prompts "${ROUTING_PROMPTS:-2000}" --concurrency 64 \
    --prefix-tenants 128 --prefix-zipf-s 0.6 --prefix-len 2048 --output-len 64 \
    --warm-requests 512 \
    --metrics-dir "$OUT/routing${ROUTING_TAG:-}_metrics" ${ROUTING_ARGS:-} \
    --out "$OUT/routing${ROUTING_TAG:-}.json" -- --load-format dummy --device cuda \
    --max-model-len 4096 --kvstore-capacity-bytes $((32 << 30)) ${ROUTING_FLAGS:-}
fi
