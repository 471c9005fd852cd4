"""Changing a flow run's tags when several processes write them.

Prefect's API replaces a flow run's tags as a whole (``PATCH /flow_runs/{id}`` with the full list): it has
no operation that adds or removes one tag.  E31's writers of tags are several (the flow process: its
attempt's checkpoint, work and loss tags; a node's prefetcher: its staged tags; the scheduler: the node a
run is placed on), so two read-modify-writes that overlap lose the first one's change.  :func:`change_tags`
reads the tags just before its write and reads them back after it, and writes again while its own change
is missing: a change lost to a concurrent writer is made again, and that writer, doing the same, makes its
own again.  What remains is a narrower window (a write that lands after the other writer's read-back),
which a server-side merge would close: Prefect's flow-run ``labels`` are merged so, and tags are not.
"""

from __future__ import annotations

from typing import Any, Callable

#: Writes of one change at most: each further one follows a concurrent writer's overwrite.
TRIES = 3


def change_tags(client: Any, run_id: Any, change: Callable[[list[str]], list[str]], tries: int = TRIES) -> bool:
    """Apply ``change`` (a pure function from a tag list to the wanted tag list, idempotent: applied to
    its own result it returns it unchanged, as a set) to the flow run ``run_id``'s tags with the sync
    client ``client``, read just before (a list read earlier would undo the writes made since).  After each
    write the tags are read back; while ``change`` would still alter them (another writer's write replaced ours), it is
    applied again, ``tries`` writes at most.  Returns whether the tags read last carry the change.

    Raises what ``client`` raises (e.g. ``prefect.exceptions.ObjectNotFound`` for a deleted run)."""
    tags = list(client.read_flow_run(run_id).tags or [])
    for _ in range(max(1, tries)):
        wanted = change(tags)
        if set(wanted) == set(tags):
            return True
        client.update_flow_run(run_id, tags=wanted)
        tags = list(client.read_flow_run(run_id).tags or [])
    return set(change(tags)) == set(tags)
