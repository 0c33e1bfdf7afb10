"""Pull-mode tasks of the Asyncflow v1 API (seeds 000, 001): workers in any language
lease tasks over HTTP instead of consuming a queue.

- :mod:`~shared.pull.rules`: statuses, order_time and retries; pure.
- :mod:`~shared.pull.service`: task types, create, hold, set; one compare-and-set per change.
- :mod:`~shared.pull.steps`: saga steps of pull-mode modules, leased as v1 tasks.

Storage is :class:`shared.storage.PullStore` (SQL, or the in-memory fake).
"""
