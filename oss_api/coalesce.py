"""Concurrent requests of one kind, stored together: one commit and one thread hop per batch.

A submit or create_task is one INSERT whose commit waits for the disk, and
PostgreSQL spends most of such a statement's CPU on that flush. The requests
that arrive while a batch is being stored wait for it to finish, then go
together in the next one: under load a batch holds every request that came
meanwhile, and alone a request goes at once, in a batch of one. No request
waits for others to come.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from starlette.concurrency import run_in_threadpool

from shared import metrics

Item = TypeVar("Item")
Answer = TypeVar("Answer")


@dataclass
class _Lane(Generic[Item, Answer]):
    """The waiting requests of one event loop, and the task storing them."""

    waiting: list[tuple[Item, asyncio.Future[Answer]]] = field(default_factory=list)
    storing: asyncio.Task[None] | None = None


class Coalescer(Generic[Item, Answer]):
    """Runs ``store`` on batches of the items awaited concurrently, in a worker thread.

    ``call`` names the requests in the batch-size metric (asyncflow_api_intake_batch_size).

    ``store`` answers each item of its batch, in order: an answer, or the
    exception that item's caller gets. An exception ``store`` raises (the
    database is down) is every caller's of the batch.
    """

    def __init__(self, call: str, store: Callable[[Sequence[Item]], Sequence[Answer | Exception]], most: int) -> None:
        self._sizes = metrics.INTAKE_BATCH.labels(call)
        self._store = store
        self._most = most
        # Per event loop: an app serves on one, but a test client may start one per request.
        self._lanes: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Lane[Item, Answer]] = (
            weakref.WeakKeyDictionary()
        )

    async def __call__(self, item: Item) -> Answer:
        loop = asyncio.get_running_loop()
        lane = self._lanes.get(loop)
        if lane is None:
            lane = self._lanes[loop] = _Lane()
        answer: asyncio.Future[Answer] = loop.create_future()
        lane.waiting.append((item, answer))
        if lane.storing is None:
            lane.storing = loop.create_task(self._drain(lane))
        return await answer

    async def _drain(self, lane: _Lane[Item, Answer]) -> None:
        try:
            while lane.waiting:
                batch, lane.waiting = lane.waiting[: self._most], lane.waiting[self._most :]
                await self._run(batch)
        except BaseException:
            for _, future in lane.waiting:
                future.cancel()
            lane.waiting = []
            raise
        finally:
            lane.storing = None

    async def _run(self, batch: list[tuple[Item, asyncio.Future[Answer]]]) -> None:
        self._sizes.observe(len(batch))
        try:
            answers = await run_in_threadpool(self._store, [item for item, _ in batch])
            if len(answers) != len(batch):
                raise RuntimeError(f"{len(batch)} items stored, {len(answers)} answered")
        except Exception as exc:
            answers = [exc] * len(batch)
        except BaseException:  # cancelled (the server stops): its callers are not left waiting
            for _, future in batch:
                future.cancel()
            raise
        for (_, future), answer in zip(batch, answers, strict=True):
            if future.done():  # its caller went away (the client disconnected)
                continue
            if isinstance(answer, Exception):
                future.set_exception(answer)
            else:
                future.set_result(answer)
