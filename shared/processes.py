"""Whether a process of this host still runs, by its pid."""

from __future__ import annotations

import os


def runs(pid: int) -> bool:
    """True while ``pid`` is a process of this host, another user's included (it may be a later
    process that reused the pid: callers that must know more look further)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
