#!/usr/bin/env bash
# Container health check without starting Python: bash's /dev/tcp only.
#   meshserve-health [PORT] [PATH]   HTTP GET PATH (default /health) on 127.0.0.1:PORT
#                                    (default $MESHSERVE_METRICS_PORT); healthy on 200
#   meshserve-health redis [PORT]    Redis PING on 127.0.0.1:PORT (default 6379); +PONG
set -u
if [[ "${1:-}" == redis ]]; then
    exec 3<>"/dev/tcp/127.0.0.1/${2:-6379}" || exit 1
    printf 'PING\r\n' >&3
    IFS= read -r -t 2 reply <&3 || exit 1
    [[ "$reply" == "+PONG"* ]]
    exit
fi
port="${1:-${MESHSERVE_METRICS_PORT:-}}"
[[ -n "$port" ]] || { echo "no port given and MESHSERVE_METRICS_PORT unset" >&2; exit 1; }
exec 3<>"/dev/tcp/127.0.0.1/${port}" || exit 1
printf 'GET %s HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n' "${2:-/health}" >&3
IFS=' ' read -r -t 2 _ code _ <&3 || exit 1
[[ "$code" == 200 ]]
