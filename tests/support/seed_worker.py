"""A v1 worker written from seed 000's interface alone: the standard library, no Asyncflow code.

It works the seed 003 video flow (moderate → poll → transcode), with failures
planned by each task's content, and writes one JSON line per lease it got, so a
test can check who held what and when:

    python seed_worker.py URL TASK_TYPE OUT_FILE

Plans (``task_content["plan"]``): ``ok``; ``fail_once`` (transcode reports status
4 once: the server retries it); ``count_retry`` (transcode reports status 1 with
crt_retry_num + 1 once: a retry counted by the worker); ``always_fail`` (moderate
reports status 4 every time: failed once the retries are spent); ``vanish``
(transcode is held once and never reported, like a worker that died: the lease
expires and the task comes back).

It stops when nothing of its type is pending or running.
"""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.parse
import urllib.request
from typing import Any

PENDING, RUNNING, SUCCESS, FAILED = 1, 2, 3, 4


class Client:
    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/") + "/v1/"

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        request = urllib.request.Request(
            self.url + path, json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=30) as response:
            return json.load(response)

    def get(self, path: str, **query: Any) -> dict[str, Any]:
        with urllib.request.urlopen(self.url + path + "?" + urllib.parse.urlencode(query), timeout=30) as response:
            return json.load(response)


def work(task: dict[str, Any]) -> dict[str, Any] | None:
    """The set_task fields for one held task, or None to vanish with it."""
    context = json.loads(task["task_content"])
    stage, plan, retries = task["task_stage"], context["plan"], task["crt_retry_num"]
    if stage == "moderate":
        if plan == "always_fail":
            return {"status": FAILED, "schedule_log": "moderation refused the upload"}
        context["job"] = f"job-{context['n']}"
        context["polls"] = 0
        return {"status": PENDING, "task_stage": "poll", "task_content": json.dumps(context)}
    if stage == "poll":
        if context["polls"] < 1:  # not done yet: same stage, look again later
            context["polls"] += 1
            return {"status": PENDING, "task_stage": "", "task_content": json.dumps(context)}
        return {"status": PENDING, "task_stage": "transcode", "task_content": json.dumps(context)}
    if retries == 0 and plan == "vanish":
        return None
    if retries == 0 and plan == "fail_once":
        return {"status": FAILED, "schedule_log": "transcoder busy"}
    if retries == 0 and plan == "count_retry":
        return {"status": PENDING, "crt_retry_num": retries + 1, "schedule_log": "transcoder busy"}
    context["url"] = f"https://cdn.example/{context['job']}.mp4"
    return {"status": SUCCESS, "task_content": json.dumps(context)}


def main(url: str, task_type: str, out_path: str) -> None:
    client = Client(url)
    configs = client.get("get_task_schedule_cfg_list")["task_schedule_cfg_list"]
    interval = next(c["schedule_interval"] for c in configs if c["task_type"] == task_type)
    idle = 0
    with open(out_path, "w") as out:
        while True:
            answer = client.post("hold_tasks", {"task_type": task_type})
            if answer["code"] != 0:
                raise SystemExit(f"hold_tasks: {answer}")
            for task in answer["task_list"]:
                record: dict[str, Any] = {
                    "pid": os.getpid(), "task_id": task["task_id"], "status": task["status"],
                    "stage": task["task_stage"], "crt_retry_num": task["crt_retry_num"], "held_at": time.time(),
                }
                fields = work(task)
                if fields is not None:
                    # Every field of the struct, as clients built on structs send them.
                    data = {"task_id": task["task_id"], "task_type": task_type, "task_stage": "",
                            "task_content": "", "schedule_log": "", "crt_retry_num": task["crt_retry_num"],
                            **fields}
                    record["reported"] = fields["status"]
                    record["set_at"] = time.time()
                    record["answer"] = client.post("set_task", {"task_data": data})
                out.write(json.dumps(record) + "\n")
                out.flush()
            if answer["task_list"]:
                idle = 0
                continue
            counts = client.get("get_task_counts_by_type", task_type=task_type)["task_count_by_status"]
            idle = idle + 1 if counts[str(PENDING)] == counts[str(RUNNING)] == 0 else 0
            if idle >= 2:
                return
            time.sleep(interval)


if __name__ == "__main__":
    main(*sys.argv[1:4])
