#!/usr/bin/env bash
# Works the steps of a pull-mode module with nothing but curl and jq: a stand-in
# DNS registrar that keeps its records in a file, one "NAME TASK_ID" per line.
#
#   examples/dns_worker.sh http://127.0.0.1:8000 dns records.txt [IDLE_POLLS]
#
# In flows.yaml the module is declared `dns: {mode: pull}` and its steps use the
# commands add_record (rollback: remove_record). Each leased step's task_stage
# is its command and its task_content a JSON object; the worker reports with
# set_task: status 3 (done; task_content, a JSON object, is merged into the
# task's Parameters), 4 (failed: the flow retries or compensates), 1 (not finished:
# lease it again later). Reports are fenced: a late one for an attempt that timed
# out is refused, so the steps below are idempotent on the record name.
#
# Parameters read: Name (the record; default: the task id), DnsFail (refuse it).
# IDLE_POLLS: stop after that many empty polls in a row (default: never stop).
# With API keys on, export ASYNCFLOW_API_KEY (an admin key) first.
set -euo pipefail

usage="usage: dns_worker.sh API_URL MODULE RECORDS_FILE [IDLE_POLLS]"
api=${1:?$usage}
module=${2:?$usage}
records=${3:?$usage}
idle_limit=${4:-0}
auth=()
if [[ -n "${ASYNCFLOW_API_KEY:-}" ]]; then auth=(-H "Authorization: Bearer ${ASYNCFLOW_API_KEY}"); fi
touch "$records"

post() {  # post PATH JSON -> the answer; prints the reason and fails on a code other than 0
  local answer
  answer=$(curl -sS --fail-with-body -X POST "${auth[@]}" -H 'Content-Type: application/json' \
    --data "$2" "$api/v1/$1")
  if [[ $(jq -r .code <<<"$answer") != 0 ]]; then
    echo "dns_worker: $1 answered $(jq -r .msg <<<"$answer")" >&2
    return 1
  fi
  printf '%s' "$answer"
}

report() {  # report STEP_ID STATUS CONTENT LOG
  post set_task "$(jq -nc --arg id "$1" --argjson s "$2" --arg c "$3" --arg l "$4" \
    '{task_data: {task_id: $id, status: $s, task_content: $c, schedule_log: $l}}')" >/dev/null \
    || true  # refused (e.g. the attempt timed out meanwhile): the flow has moved on
}

run_step() {  # run_step TASK_JSON
  local id command content name
  id=$(jq -r .task_id <<<"$1")
  command=$(jq -r .task_stage <<<"$1")
  content=$(jq -r .task_content <<<"$1")
  name=$(jq -r '.parameters.Name // .task_id' <<<"$content")
  local line="$name $(jq -r .task_id <<<"$content")"
  echo "$command $id"
  case "$command" in
    add_record)
      if [[ $(jq -r '.parameters.DnsFail // false' <<<"$content") == true ]]; then
        report "$id" 4 "" "registrar refused $name"
      else
        grep -qxF -- "$line" "$records" || echo "$line" >>"$records"
        report "$id" 3 "$(jq -nc --arg n "$name" '{Record: ($n + ".example.internal")}')" "added $name"
      fi ;;
    remove_record)
      grep -vxF -- "$line" "$records" >"$records.tmp" || true
      mv "$records.tmp" "$records"
      report "$id" 3 "" "removed $name" ;;
    *)
      report "$id" 4 "" "dns_worker.sh has no command $command" ;;
  esac
}

idle=0
while :; do
  tasks=$(post hold_tasks "$(jq -nc --arg t "$module" '{task_type: $t}')" | jq -c '.task_list[]')
  if [[ -z "$tasks" ]]; then
    idle=$((idle + 1))
    if [[ $idle_limit -gt 0 && $idle -ge $idle_limit ]]; then exit 0; fi
    sleep 0.2  # the poll interval: nothing to lease right now
    continue
  fi
  idle=0
  while IFS= read -r task; do run_step "$task"; done <<<"$tasks"
done
