#!/usr/bin/env bash
# A v1 pull-mode worker with nothing but curl and jq: proof that any language can
# be an Asyncflow worker. It leases tasks of one type, replaces each task's
# content by the SHA-256 of that content, and reports success.
#
#   examples/curl_worker.sh http://127.0.0.1:8000 checksum [IDLE_POLLS]
#
# IDLE_POLLS: stop after that many empty polls in a row (default: never stop).
# With API keys on, export ASYNCFLOW_API_KEY (an admin key) first.
set -euo pipefail

api=${1:?usage: curl_worker.sh API_URL TASK_TYPE [IDLE_POLLS]}
task_type=${2:?usage: curl_worker.sh API_URL TASK_TYPE [IDLE_POLLS]}
idle_limit=${3:-0}
auth=()
if [[ -n "${ASYNCFLOW_API_KEY:-}" ]]; then auth=(-H "Authorization: Bearer ${ASYNCFLOW_API_KEY}"); fi

post() {  # post PATH JSON -> the answer; a code other than 0 stops the worker
  local answer
  answer=$(curl -sS --fail-with-body -X POST "${auth[@]}" -H 'Content-Type: application/json' \
    --data "$2" "$api/v1/$1")
  if [[ $(jq -r .code <<<"$answer") != 0 ]]; then
    echo "worker: $1 answered $(jq -r .msg <<<"$answer")" >&2
    return 1
  fi
  printf '%s' "$answer"
}

idle=0
while :; do
  tasks=$(post hold_tasks "$(jq -nc --arg t "$task_type" '{task_type: $t}')" | jq -c '.task_list[]')
  if [[ -z "$tasks" ]]; then
    idle=$((idle + 1))
    if [[ $idle_limit -gt 0 && $idle -ge $idle_limit ]]; then exit 0; fi
    sleep 0.2  # the poll interval: nothing to lease right now
    continue
  fi
  idle=0
  while IFS= read -r task; do
    id=$(jq -r .task_id <<<"$task")
    digest=$(jq -j .task_content <<<"$task" | sha256sum | cut -d' ' -f1)
    post set_task "$(jq -nc --arg id "$id" --arg c "$digest" \
      '{task_data: {task_id: $id, status: 3, task_content: $c, schedule_log: "sha256 by curl_worker.sh"}}')" >/dev/null
    echo "done $id"
  done <<<"$tasks"
done
