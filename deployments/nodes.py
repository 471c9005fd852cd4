"""``e31 node NODE --pool POOL.yaml [--down]``: a node's fences, and the
operator's word that a silent machine is off.

A node taken for lost while a run ran there is fenced
(:mod:`e31.tasks.supervisor.fence`): nothing new is placed on it, and the
lost runs' attempts elsewhere wait, until the runs' processes there are
confirmed gone.  When the machine will not come back (powered off,
reinstalled), ``--down`` says its processes are gone: the requeued
attempts may start on other nodes.  The node itself stays fenced until an
``e31 worker`` starts there again and finds nothing of those runs left (as
a Slurm node set ``DOWN`` takes no job until it is resumed).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from e31.errors import EXIT_FAILED, EXIT_OK


def declare_down(client: Any, pool: str, node: str) -> list[dict]:
    """Mark every fence of ``node`` in the pool named ``pool`` ``down``
    (``client``: Prefect's sync client); returns the fences' values."""
    from prefect.client.schemas.actions import VariableUpdate

    from e31.tasks.supervisor.fence import read_fences

    fences = {name: f for name, f in read_fences(client, pool).items() if f["node"] == node}
    for name, fence in fences.items():
        fence["down"] = True
        client.update_variable(VariableUpdate(name=name, value=fence))
    return list(fences.values())


def cmd_node(args: argparse.Namespace) -> int:
    """Print the node's fences; with ``--down``, declare them ended first.
    A node no longer in the pool file is accepted while fences name it (a
    machine taken out of the file after it was lost still holds its runs'
    retries back)."""
    from prefect.client.orchestration import get_client

    from e31.specs.pool import load_pool
    from e31.tasks.supervisor.fence import read_fences

    pool = load_pool(args.pool)
    names = {name for n in pool.nodes for name in n.names()}
    with get_client(sync_client=True) as client:
        fences = [f for f in read_fences(client, pool.name).values() if f["node"] == args.node]
        if args.node not in names and not fences:
            print(f"e31: node: no node {args.node!r} in pool {pool.name} (its nodes: {', '.join(sorted(names))}); "
                  "give one of them", file=sys.stderr)
            return EXIT_FAILED
        if args.down:
            fences = declare_down(client, pool.name, args.node)
    if not fences:
        print(f"node {args.node}: not fenced (no run was lost there with processes unaccounted for)")
        return EXIT_OK
    runs = ", ".join(f"{f.get('job')} ({str(f['run'])[:8]})" for f in fences)
    if args.down:
        print(f"node {args.node}: declared down: the attempts of {runs} there count as ended, and their retries may "
              f"start on other nodes; {args.node} takes no new job until its e31 worker starts there again and "
              "finds nothing of them left")
    else:
        down = all(f.get("down") for f in fences)
        print(f"node {args.node}: fenced: {runs} {'were' if len(fences) > 1 else 'was'} lost there while running; "
              + ("declared down: it takes no new job until its e31 worker starts there again" if down else
                 "it takes no new job, and their retries wait, until its e31 worker (started again there) or the "
                 "runs' own flow processes confirm that their processes are gone; if the machine is off for good: "
                 f"e31 node {args.node} --pool {args.pool} --down"))
    return EXIT_OK
