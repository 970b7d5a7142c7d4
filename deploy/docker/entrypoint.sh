#!/usr/bin/env bash
# Container entry point. Configuration comes from a file and the environment:
#   serve [--config FILE] [flags]  the service; FILE defaults to $PIPELINE_CONFIG_FILE or
#                                  /etc/odb-pipeline/pipeline.yaml (the ConfigMap mount); every
#                                  setting can be overridden by ODB_* env (ODB_REDIS_URL,
#                                  ODB_RAY__ADDRESS, ODB_GRPC__PORT, ...), job tokens come from the
#                                  env vars named by each job's token_env. With RAY_JOIN_ADDRESS
#                                  (the head's GCS, host:6379) this container first becomes a
#                                  Ray node of that cluster: `ray start --address=... $RAY_START_ARGS`
#                                  (retried RAY_JOIN_TRIES times, RAY_JOIN_RETRY_SECONDS apart,
#                                  while the head comes up), so the service reads payloads
#                                  through the node's object manager (never the Ray Client proxy).
#   plan|status|inspect|demo ...   the other odb-pipeline commands
#   train [torchrun args] SCRIPT   torchrun (trainers; env PIPELINE_ENDPOINT/_JOB/_TOKEN)
#   anything else                  run as given (ray, python, bash, ...)
set -euo pipefail

cmd="${1:-serve}"
[ $# -gt 0 ] && shift

join_ray() {
  local tries="${RAY_JOIN_TRIES:-60}" i
  for ((i = 1; ; i++)); do
    # shellcheck disable=SC2086  # RAY_START_ARGS is a list of flags
    if ray start --address="$RAY_JOIN_ADDRESS" ${RAY_START_ARGS:-} --disable-usage-stats; then
      return 0
    fi
    if [ "$i" -ge "$tries" ]; then
      echo "odb-entrypoint: could not join the Ray cluster at $RAY_JOIN_ADDRESS" \
           "($tries tries)" >&2
      exit 3
    fi
    sleep "${RAY_JOIN_RETRY_SECONDS:-5}"
  done
}

case "$cmd" in
  serve)
    args=("$@")
    given=0
    for arg in "$@"; do
      if [ "$arg" = "--config" ] || [[ "$arg" == --config=* ]]; then
        given=1
      fi
    done
    if [ "$given" = 0 ]; then
      config="${PIPELINE_CONFIG_FILE:-/etc/odb-pipeline/pipeline.yaml}"
      if [ ! -f "$config" ]; then
        echo "odb-entrypoint: config file $config not found (mount the ConfigMap there," \
             "set PIPELINE_CONFIG_FILE or pass --config)" >&2
        exit 2
      fi
      args=(--config "$config" "$@")
    fi
    if [ -n "${RAY_JOIN_ADDRESS:-}" ]; then
      join_ray
    fi
    exec odb-pipeline serve "${args[@]}"
    ;;
  plan|status|inspect|demo)
    exec odb-pipeline "$cmd" "$@"
    ;;
  train)
    exec torchrun "$@"
    ;;
  *)
    exec "$cmd" "$@"
    ;;
esac
