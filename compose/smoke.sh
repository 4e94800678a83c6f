#!/usr/bin/env bash
# Smoke test of the compose stack, end to end: build the image, bring the stack up with two
# tokenizers and two workers, wait until every container is healthy, send requests through
# the OpenAI API, find a request's trace in Jaeger, tear everything down. Prints timings.
#
#   compose/smoke.sh                     # bridge networking (the default compose file)
#   compose/smoke.sh --host              # + docker-compose.host.yml (no bridge networking)
#   compose/smoke.sh --host --no-tracing # without Jaeger (when its image cannot be had)
#   compose/smoke.sh --host --trace-file=/tmp/spans.jsonl  # no Jaeger either: the services
#       # export to MESHSERVE_OTLP_ENDPOINT, where loadtest/otlp_sink.py writes that file
#   compose/smoke.sh --no-build --keep   # reuse the image; leave the stack running
#
# Ports, the model and the image come from the MESHSERVE_* variables the compose file
# reads (see its header); e.g. MESHSERVE_GATEWAY_PORT=18000 moves the API in host mode.
# Exits non-zero at the first failed step, naming it.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
files=(-f "$here/docker-compose.yml")
host=0 tracing=1 build=1 keep=0 trace_file="" wait_s="${SMOKE_WAIT_S:-900}"
for arg in "$@"; do
    case "$arg" in
        --host) host=1; files+=(-f "$here/docker-compose.host.yml") ;;
        --no-tracing) tracing=0 ;;
        --trace-file=?*) trace_file="${arg#--trace-file=}" ;;
        --no-build) build=0 ;;
        --keep) keep=1 ;;
        *) echo "unknown option: $arg (see the header of $0)" >&2; exit 2 ;;
    esac
done
dc() { docker compose "${files[@]}" "$@"; }
now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }
step() { printf '\n== %s\n' "$*"; }
fail() { echo "SMOKE FAILED: $*" >&2; exit 1; }

secret="${MESHSERVE_API_KEY_SECRET:-$here/secrets/api_key}"
# The gateway runs as uid 10001 and compose mounts a file secret as it is on the host: the
# file must be readable by that user. Kept private by its folder (0700) instead.
if [[ ! -s "$secret" ]]; then
    mkdir -p "$(dirname "$secret")" && chmod 700 "$(dirname "$secret")"
    head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n' > "$secret"
    chmod 644 "$secret"
    echo "created an API key in $secret"
fi
[[ "$(stat -c %A "$secret")" == *r?? ]] \
    || fail "$secret must be readable by the gateway's user (uid 10001): chmod 644 it"
key="$(head -n 1 "$secret")"
if (( host )); then api_port="${MESHSERVE_GATEWAY_PORT:-8000}"; else api_port="${MESHSERVE_API_PORT:-8000}"; fi
api="http://127.0.0.1:${api_port}"
jaeger="http://127.0.0.1:${MESHSERVE_JAEGER_UI_PORT:-16686}"
services=(redis tokenizer scheduler kvstore worker gateway)
(( host )) || services+=(gateway-proxy)
if [[ -n "$trace_file" ]]; then
    (( tracing )) || fail "--trace-file and --no-tracing exclude each other"
    [[ -n "${MESHSERVE_OTLP_ENDPOINT:-}" ]] \
        || fail "--trace-file: set MESHSERVE_OTLP_ENDPOINT to the receiver that writes it"
    [[ -f "$trace_file" ]] || fail "--trace-file: $trace_file does not exist (start the sink)"
elif (( tracing )); then
    services+=(jaeger); (( host )) || services+=(otel-collector)
else
    export MESHSERVE_OTLP_ENDPOINT=""  # empty: the services export no spans
fi

teardown() {
    local rc=$?
    if (( rc != 0 )); then
        step "state at failure"
        dc ps -a || true
        dc logs --tail 40 || true
    fi
    if (( keep )); then echo "stack left running (--keep)"; else
        step "tear down"; dc down --volumes --remove-orphans --timeout 40 || true
    fi
    exit "$rc"
}
trap teardown EXIT

build_s="skipped"
if (( build )); then
    step "build (one image: the tokenizer service builds it; every other service runs its tag)"
    t0="$(now)"
    dc build tokenizer || fail "build"
    build_s="$(since "$t0")"
fi
docker image ls "${MESHSERVE_IMAGE:-meshserve:latest}"

step "up: ${services[*]} with --scale tokenizer=2 --scale worker=2, waiting for healthy"
t0="$(now)"
dc up -d --no-build --wait --wait-timeout "$wait_s" --scale tokenizer=2 --scale worker=2 \
    "${services[@]}" || fail "the stack did not become healthy within ${wait_s}s"
healthy_s="$(since "$t0")"
dc ps

step "every replica healthy and registered"
for service in tokenizer worker; do
    count="$(dc ps --status running --format '{{.Service}} {{.Health}}' | grep -c "^$service healthy$" || true)"
    [[ "$count" == 2 ]] || fail "$service: $count healthy replicas, expected 2"
    echo "$service: 2 healthy replicas"
done
health="$(curl -sS "$api/health")" || fail "GET /health"
echo "gateway /health: $health"
grep -q '"workers": *2' <<<"$health" || fail "the scheduler does not list both workers"

step "the API wants the key"
code="$(curl -s -o /dev/null -w '%{http_code}' "$api/v1/models")"
[[ "$code" == 401 ]] || fail "GET /v1/models without a key answered $code, expected 401"
echo "without a key: $code"
models="$(curl -sS --fail-with-body -H "Authorization: Bearer $key" "$api/v1/models")" \
    || fail "GET /v1/models"
echo "models: $models"
model="$(sed -n 's/.*"id": *"\([^"]*\)".*/\1/p' <<<"$models" | head -n 1)"
[[ -n "$model" ]] || fail "no model listed"

step "requests: 4 chat completions, a streamed chat completion, a completion"
t0="$(now)"
for i in 1 2 3 4; do
    reply="$(curl -sS --fail-with-body -H "Authorization: Bearer $key" \
        -H 'Content-Type: application/json' "$api/v1/chat/completions" \
        -d "{\"model\": \"$model\", \"max_tokens\": 16, \"temperature\": 0,
             \"messages\": [{\"role\": \"user\", \"content\": \"Count to $i.\"}]}")" \
        || fail "chat completion $i: $reply"
    grep -q '"finish_reason"' <<<"$reply" || fail "chat completion $i: $reply"
    echo "chat $i: $(sed -n 's/.*"content": *"\([^"]*\)".*/\1/p' <<<"$reply" | head -c 120)"
done
stream="$(curl -sS -N --fail-with-body -H "Authorization: Bearer $key" \
    -H 'Content-Type: application/json' "$api/v1/chat/completions" \
    -d "{\"model\": \"$model\", \"max_tokens\": 16, \"stream\": true,
         \"messages\": [{\"role\": \"user\", \"content\": \"Say hello.\"}]}")" \
    || fail "streamed chat completion"
chunks="$(grep -c '^data: {' <<<"$stream" || true)"
grep -q '^data: \[DONE\]' <<<"$stream" || fail "the stream did not end with [DONE]"
echo "streamed chat: $chunks chunks, then [DONE]"
completion="$(curl -sS --fail-with-body -H "Authorization: Bearer $key" \
    -H 'Content-Type: application/json' "$api/v1/completions" \
    -d "{\"model\": \"$model\", \"prompt\": \"The capital of France is\", \"max_tokens\": 8}")" \
    || fail "completion: $completion"
echo "completion: $(head -c 300 <<<"$completion")"
requests_s="$(since "$t0")"

# The first trace id in a span file (loadtest/otlp_sink.py's JSON lines) that has spans
# from the gateway, a tokenizer, the scheduler and a worker.
complete_trace() {
    awk -F'"' '{
        for (i = 2; i < NF; i += 2) {
            if ($i == "trace_id") id = $(i + 2); if ($i == "service") svc = $(i + 2)
        }
        if (!(id in order)) { order[id] = ++n; ids[n] = id }
        seen[id, svc] = 1
    } END {
        for (k = 1; k <= n; k++) {
            id = ids[k]
            if (seen[id, "gateway"] && seen[id, "tokenizer"] && seen[id, "scheduler"] \
                && seen[id, "worker"]) { print id; exit }
        }
    }' "$1"
}

trace="skipped (--no-tracing)"
if [[ -n "$trace_file" ]]; then
    step "a request's trace in $trace_file (what the services sent to $MESHSERVE_OTLP_ENDPOINT)"
    trace_id=""
    for _ in $(seq 30); do  # spans leave each service in batches: ask again for a minute
        trace_id="$(complete_trace "$trace_file")"
        [[ -n "$trace_id" ]] && break
        sleep 2
    done
    [[ -n "$trace_id" ]] || fail "no trace with gateway, tokenizer, scheduler and worker spans"
    spans="$(grep -F "\"trace_id\": \"$trace_id\"" "$trace_file")"
    services_seen="$(sed -n 's/.*"service": "\([a-z]*\)".*/\1/p' <<<"$spans" | sort -u | tr '\n' ' ')"
    echo "trace $trace_id: $(wc -l <<<"$spans") spans"
    sed -n 's/.*"service": "\([^"]*\)", "name": "\([^"]*\)".*/  \1: \2/p' <<<"$spans"
    trace="found in $trace_file, spans from: $services_seen"
elif (( tracing )); then
    step "a request's trace in Jaeger ($jaeger/api/traces?service=gateway)"
    # Spans leave each service in batches (every few seconds): ask again for up to a minute.
    for _ in $(seq 30); do
        traces="$(curl -sS "$jaeger/api/traces?service=gateway&limit=20&lookback=1h" || true)"
        if grep -q '"traceID"' <<<"$traces"; then break; fi
        sleep 2
    done
    grep -q '"traceID"' <<<"$traces" || fail "no gateway trace in Jaeger"
    services_seen="$(grep -o '"serviceName": *"[a-z]*"' <<<"$traces" | sort -u | tr '\n' ' ')"
    echo "trace services: $services_seen"
    for role in tokenizer scheduler worker; do
        grep -q "\"$role\"" <<<"$services_seen" || fail "the traces have no $role span"
    done
    trace="found, spans from: $services_seen"
fi

step "summary"
image_size="$(docker image inspect -f '{{.Size}}' "${MESHSERVE_IMAGE:-meshserve:latest}")"
printf '%-28s %s\n' "networking" "$( (( host )) && echo host || echo bridge )" \
    "image size" "$(awk -v b="$image_size" 'BEGIN { printf "%.2f GB", b / 1e9 }')" \
    "build (s)" "$build_s" "up to healthy (s)" "$healthy_s" \
    "requests (s)" "$requests_s" "trace" "$trace"
echo "SMOKE PASSED"
