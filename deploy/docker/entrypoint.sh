#!/usr/bin/env bash
# Container entry point. Configuration comes from a file and the environment:
#   serve [--config FILE] [flags]  the service; FILE defaults to $PIPELINE_CONFIG_FILE or
#                                  /etc/odb-pipeline/pipeline.yaml (the ConfigMap mount); every
#                                  setting can be overridden by ODB_* env (ODB_REDIS_URL,
#                                  ODB_RAY__ADDRESS, ODB_GRPC__PORT, ...), job tokens come from the
#                                  env vars named by each job's token_env.
#   plan|status|inspect|demo ...   the other odb-pipeline commands
#   train [torchrun args] SCRIPT   torchrun (trainers; env PIPELINE_ENDPOINT/_JOB/_TOKEN)
#   anything else                  run as given (ray, python, bash, ...)
set -euo pipefail

cmd="${1:-serve}"
[ $# -gt 0 ] && shift

case "$cmd" in
  serve)
    for arg in "$@"; do
      if [ "$arg" = "--config" ] || [[ "$arg" == --config=* ]]; then
        exec odb-pipeline serve "$@"
      fi
    done
    config="${PIPELINE_CONFIG_FILE:-/etc/odb-pipeline/pipeline.yaml}"
    if [ ! -f "$config" ]; then
      echo "odb-entrypoint: config file $config not found (mount the ConfigMap there," \
           "set PIPELINE_CONFIG_FILE or pass --config)" >&2
      exit 2
    fi
    exec odb-pipeline serve --config "$config" "$@"
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
