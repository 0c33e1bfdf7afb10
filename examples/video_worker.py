"""A multi-stage video worker on the Asyncflow SDK (seed 003 §三).

Each stage does one short thing and hands the task back to the server, so a
slow external job never holds a worker thread (seed 001 §一):

    ""/"submit"         submit a moderation job           -> check_moderation
    check_moderation    not finished: poll again later;
                        rejected: done (approved: false);
                        approved: submit a transcode job  -> check_transcode
    check_transcode     not finished: poll again later;
                        finished: done, content has the transcoded URL

The external service is examples/fake_media_service.py (started in-process
unless --media is given). Against a local server:

    asyncflow up                                             # terminal 1
    python examples/video_worker.py --api http://127.0.0.1:8000   # terminal 2
    curl -s -X POST http://127.0.0.1:8000/v1/create_task \\
      -H 'Content-Type: application/json' \\
      -d '{"task_data": {"task_type": "video", "task_content": "{\\"source\\": \\"http://example.com/cat.mp4\\"}"}}'
    curl -s 'http://127.0.0.1:8000/v1/get_task?task_id=<the task_id printed above>'

With API keys on, pass an admin key: --api-key KEY (or ASYNCFLOW_API_KEY) and
add ``-H "Authorization: Bearer KEY"`` to the curl commands.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading
from typing import Any

import httpx

from asyncflow.sdk import Done, Job, NextStage, Outcome, PollAgain, Worker

try:
    from examples.fake_media_service import FakeMediaService
except ImportError:  # run as a script: examples/ is sys.path[0]
    from fake_media_service import FakeMediaService  # type: ignore[no-redef]

TASK_TYPE = "video"
# Retry a failed attempt at most 3 times, 1, 2, then 4 s later (progressive);
# poll each task every second; a stage must report within 60 s.
TYPE_CONFIG: dict[str, Any] = {
    "schedule_limit": 20,
    "schedule_interval": 1,
    "max_processing_time": 60,
    "max_retry_num": 3,
    "max_retry_interval": 4,
}


def build_worker(api: str, media: str, *, media_http: httpx.Client | None = None, **options: Any) -> Worker:
    """The video worker: ``options`` go to :class:`Worker` (http, max_threads...)."""
    worker = Worker(api, TASK_TYPE, **options)
    service = media_http or httpx.Client(timeout=10, transport=httpx.HTTPTransport(retries=3))

    def submit_job(kind: str, source: str) -> str:
        response = service.post(f"{media}/jobs", json={"kind": kind, "source": source})
        response.raise_for_status()  # an error here is a failed attempt: the server retries
        return str(response.json()["job_id"])

    def job_state(job_id: str) -> dict[str, Any]:
        response = service.get(f"{media}/jobs/{job_id}")
        response.raise_for_status()
        state: dict[str, Any] = response.json()
        return state

    @worker.stage("")
    @worker.stage("submit")
    def submit(job: Job) -> Outcome:
        content = job.content_json()
        content["moderation_job"] = submit_job("moderate", content["source"])
        return NextStage("check_moderation", content, log=f"moderation job {content['moderation_job']}")

    @worker.stage("check_moderation")
    def check_moderation(job: Job) -> Outcome:
        content = job.content_json()
        state = job_state(content["moderation_job"])
        if state["state"] != "done":
            return PollAgain()  # content unchanged: it keeps the job id
        if not state["result"]["approved"]:
            # A verdict, not an error: retrying would get the same answer.
            return Done({**content, "approved": False}, log="rejected by moderation")
        content["approved"] = True
        content["transcode_job"] = submit_job("transcode", content["source"])
        return NextStage("check_transcode", content, log=f"transcode job {content['transcode_job']}")

    @worker.stage("check_transcode")
    def check_transcode(job: Job) -> Outcome:
        content = job.content_json()
        state = job_state(content["transcode_job"])
        if state["state"] != "done":
            return PollAgain()
        return Done({**content, "url": state["result"]["url"]}, log="transcoded")

    return worker


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--api", default="http://127.0.0.1:8000", help="Asyncflow API URL")
    parser.add_argument("--media", default=None, help="media service URL (default: a fake one in-process)")
    parser.add_argument("--media-duration", type=float, default=3.0, help="seconds a fake media job takes")
    parser.add_argument("--api-key", default=os.environ.get("ASYNCFLOW_API_KEY"), help="an admin API key")
    parser.add_argument("--threads", type=int, default=8)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per poll is noise

    fake = None
    if args.media is None:
        fake = FakeMediaService(duration=args.media_duration).start()
        logging.info("fake media service on %s", fake.url)
    worker = build_worker(args.api, args.media or fake.url, api_key=args.api_key, max_threads=args.threads)
    worker.register_task_type(**TYPE_CONFIG)
    stop = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        # Ctrl-C or `kill`: stop polling; run() then drains the jobs already started.
        logging.info("signal %d: stopping after the running jobs", signum)
        stop.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        worker.run(stop)
    finally:
        worker.close()
        if fake is not None:
            fake.close()


if __name__ == "__main__":
    main()
