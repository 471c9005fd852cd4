"""What ``e31 submit`` and ``e31 queue`` say of a run: its plan, or what
it is doing while it holds its node (read from the scheduler's snapshot)."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from e31.flows.placement.text import where


def submitted_line(snap: Any, placements: list[Any], key: str) -> str | None:
    """What ``e31 submit`` says of the run ``key`` it just queued, from a
    snapshot read after the submission: its plan (start now on a node, or
    waiting and why), held back behind another run of the same job,
    already placed by the scheduler (which may tick between the submission
    and this read), or handed over behind a running job; None when the run
    is in none of them (it ended already)."""
    from e31.flows.queue import humane

    mine = next((p for p in placements if p.job == key), None)
    if mine is not None:
        return humane(describe(mine), snap)
    if key in snap.blocked:
        return humane(snap.blocked[key], snap)  # "waiting for the run ... of this job, ..., to end"
    if key in snap.behind:
        ahead = snap.behind[key]
        return f"handed over behind {snap.specs[ahead].name} ({ahead[:8]}): its work starts once that job has ended"
    held = next((r for r in snap.running if r.id == key), None)
    if held is not None:
        state = holding(snap.runs[key].state)  # not "placed ... already: placed: ..."
        return f"placed on {held.node}{_gpus(held.devices)} by the scheduler already: {state.removeprefix('placed: ')}"
    return None


def _gpus(devices: Any) -> str:
    """``, GPUs 0,1`` (device numbers) for a placement's devices, or nothing."""
    return f", GPUs {','.join(map(str, devices))}" if devices else ""


def describe(p: Any) -> str:
    """One placement in words: ``start now on NODE, GPUs 0,1``, ``refused: ...`` or its waiting reason."""
    if p.action == "start":
        if getattr(p, "gang", ()):
            nodes, devices = where(p.node, p.devices, p.gang)
            return f"start now on {nodes}" + (f", GPUs {devices}" if p.devices else "")
        return f"start now on {p.node}{_gpus(p.devices)}"
    if p.action == "refuse":
        return f"refused: {p.reason}"
    return p.reason if p.reason.startswith("waiting") else f"waiting: {p.reason}"


def holding(state: Any, labels: dict[str, Any] | None = None) -> str:
    """What ``e31 queue`` says of a run that holds its node's resources,
    from its flow run ``state`` (Prefect's ``Scheduled`` named ``Placed``,
    ``Pending``, ``Running`` or ``Cancelling``) and, for a running one, the
    step of its attempt in its ``labels`` (``e31.step``:
    :mod:`e31.flows.attempt.steplabel`)."""
    from e31.deployments.cutreturn import RETURNING
    from e31.flows.queue import SETTLE_S
    from e31.states import PREEMPTING

    kind = state.type.value
    if kind == "CRASHED":  # a fresh crash (under SETTLE_S) keeps its node: see e31.flows.queue.snapshot.read
        return (f"crashed: its node stays its own for {SETTLE_S:g} s (its worker may yet finish a return it cut), "
                "then it is freed")
    if kind == "PENDING" and state.name == RETURNING:
        return "returning: its flow process ended during the return of its output; its worker finishes the return"
    if kind == "CANCELLING" and state.name == PREEMPTING:
        return ("preempting: its work is being stopped and its latest output returned, for a job with priority over "
                "it; then it is queued again and resumes from there")
    if kind == "CANCELLING":
        return "cancelling: its work is being stopped and its latest output returned"
    if kind == "PENDING":
        return "starting: its worker is starting its flow process"
    if kind == "SCHEDULED":
        return "placed: its worker starts it within seconds"
    step = (labels or {}).get("e31.step")
    return f"running: {STEP_WORDS[step]}" if step in STEP_WORDS else "running"


#: What ``e31 queue`` adds to a running run for its attempt's step (its work itself: plain "running").
STEP_WORDS = {"stage": "staging its inputs", "gates": "checking it may start its work",
              "return": "returning its output"}


def _hhmm(ts: float | None) -> str:
    return datetime.fromtimestamp(ts, timezone.utc).strftime("%H:%M UTC") if ts else "-"


def job_rows(snap: Any, placements: list[Any], staging: dict[str, str] | None = None) -> list[tuple[str, ...]]:
    """The rows of ``e31 queue``'s job table (a header, then one per run):
    JOB, RUN (the id's first 8 characters), STATE, NODE, GPUS, START (the
    start of the run's current attempt, ``HH:MM UTC``:
    :func:`e31.flows.queue.snapshot.attempt_start`; or its planned start),
    REASON.  The runs that hold a node (those it plans with, each followed
    by the runs handed over behind it, then those it took for lost with
    their node), then ``placements`` (the planner's answer for the queued
    runs; ``staging``: run id -> its inputs' staging progress), the runs
    held back behind another run of their job, and the crashed and the
    preempted runs about to be queued again."""
    from e31.flows.queue import DEVICES_VAR, NODE_VAR, humane, placement_of
    from e31.flows.queue.snapshot import attempt_start

    staging = staging or {}
    rows = [("JOB", "RUN", "STATE", "NODE", "GPUS", "START", "REASON")]
    for r in sorted(snap.running, key=lambda j: (j.node, j.start)):
        if r.id not in snap.runs:  # a node held for want of a live worker
            continue
        run = snap.runs[r.id]
        rows.append((snap.specs[r.id].name, r.id[:8], run.state.name, *where(r.node, r.devices, getattr(r, "gang", ())),
                     _hhmm(r.start), holding(run.state, getattr(run, "labels", None)) + silent_note(snap, r.node, snap.now)))
        for key, ahead in snap.behind.items():  # handed over behind it: flow process started, work not yet
            run, follower = snap.runs[key], placement_of(snap.runs[key])
            if ahead == r.id:
                rows.append((snap.specs[key].name, key[:8], run.state.name, r.node,
                             ",".join(map(str, follower.get("gpu_devices") or ())) or "-", "-",
                             f"handed over behind {snap.specs[ahead].name} ({ahead[:8]}): its work starts once that "
                             "job has returned its output"))
    for key in snap.lost:  # on a node silent past the lease: still holding until the scheduler crashes them
        run, placed = snap.runs[key], placement_of(snap.runs[key])
        rows.append((snap.specs[key].name, key[:8], run.state.name, placed.get(NODE_VAR) or "-",
                     ",".join(map(str, placed.get(DEVICES_VAR) or ())) or "-", _hhmm(attempt_start(run)),
                     holding(run.state) + silent_note(snap, placed.get(NODE_VAR), snap.now)))
    for p in placements:
        reason = humane(p.reason, snap) + (f"; {staging[p.job]}" if p.job in staging else "") + \
            (silent_note(snap, p.node, snap.now) if p.action == "start" else "")
        rows.append((snap.specs[p.job].name, p.job[:8], "Queued", *where(p.node, p.devices, p.gang),
                     _hhmm(p.start), reason))
    for key, why in sorted(snap.blocked.items(), key=lambda kv: snap.runs[kv[0]].created or 0):  # a job's later runs
        rows.append((snap.specs[key].name, key[:8], "Queued", "-", "-", "-", humane(why, snap)))
    for key in snap.requeue:  # crashed, with retries left: queued again at the scheduler's next tick
        run = snap.runs[key]
        rows.append((snap.specs[key].name, key[:8], run.state.name, placement_of(run).get(NODE_VAR) or "-",
                     "-", "-", crashed_line(run, snap.specs[key].request.retries)))
    for key in snap.preempted:  # its output returned: queued again at the scheduler's next tick
        run = snap.runs[key]
        rows.append((snap.specs[key].name, key[:8], run.state.name, "-", "-", "-",
                     f"{run.state.message or 'preempted'}; queued again at the scheduler's next tick, resumes "
                     "from there"))
    return rows


#: Seconds of silence after which ``e31 queue`` calls a node's worker late: two missed heartbeats (every 10 s).
SILENT_S = 20.0


def _runs_on(snap: Any, node: str) -> list[Any]:
    """The flow runs that hold ``node``'s resources: those the snapshot
    plans with, and those it took for lost with the node (past the lease)."""
    from e31.flows.queue import NODE_VAR, placement_of

    held = [snap.runs[r.id] for r in snap.running if r.node == node and r.id in snap.runs]
    return held + [snap.runs[k] for k in getattr(snap, "lost", ()) if k in snap.runs
                   and placement_of(snap.runs[k]).get(NODE_VAR) == node]


def _retries_left(snap: Any, run: Any) -> bool:
    """Whether ``run`` may be queued again after a crash (Prefect's
    ``run_count``: the attempts that started; the spec's ``request.retries``)."""
    spec = getattr(snap, "specs", {}).get(str(run.id))
    return spec is not None and (run.run_count or 0) <= spec.request.retries


def worker_words(snap: Any, node: str, now: float) -> str:
    """What ``e31 queue`` says of node ``node``'s worker, from its last
    heartbeat (``snap.heard``; Unix seconds on the server's clock, as
    ``now``), the lease (``snap.lease_s``: the live scheduler's when
    ``snap.scheduler_heard``) and :data:`e31.flows.queue.cache.LOST_CONFIRM_S`:

    - ``heard 3 s ago`` within :data:`SILENT_S` (two heartbeats);
    - ``late: last heard 45 s ago; ...`` past it and within the lease (its
      runs keep their resources until the lease's end, said as a clock time);
    - ``late: ... past the lease ...`` past the lease but not yet confirmed
      (the scheduler takes a node for lost once it has stayed silent
      ``LOST_CONFIRM_S`` past the lease; nothing new is placed there);
    - ``lost: ...`` beyond that: its runs are crashed, and queued again only
      those with retries left;
    - ``no worker heard: ...`` when the work pool knows no worker of it."""
    from e31.flows.placement.text import clock
    from e31.flows.queue.cache import LOST_CONFIRM_S

    beat = snap.heard.get(node)
    if beat is None:
        return "no worker heard: nothing starts here until one runs (e31 worker --node " + node + ")"
    age, lease_s = max(0.0, now - beat), snap.lease_s
    if age <= SILENT_S:
        return f"heard {age:.0f} s ago"
    runs = _runs_on(snap, node)
    ends = clock(beat + lease_s, now)
    unheard = "" if snap.scheduler_heard else \
        f" ({lease_s:g} s unless e31 scheduler --lease says otherwise; no scheduler heard)"
    if age <= lease_s:
        if runs:
            return f"late: last heard {age:.0f} s ago; its runs keep their resources until the lease ends at {ends}" + \
                unheard
        return (f"late: last heard {age:.0f} s ago; it holds no run; nothing new is placed here from the lease's end "
                f"at {ends}{unheard} until it is heard again")
    if age <= lease_s + LOST_CONFIRM_S:
        if runs:
            return (f"late: last heard {age:.0f} s ago, past the lease that ended at {ends}{unheard}: nothing new is "
                    f"placed here; its runs keep their resources unless it is still silent at "
                    f"{clock(beat + lease_s + LOST_CONFIRM_S, now)}, when it is lost")
        return (f"late: last heard {age:.0f} s ago, past the lease that ended at {ends}{unheard}: nothing is placed "
                "here until it is heard again")
    words = (f"lost: last heard {age:.0f} s ago, past the lease that ended at {ends}{unheard}: nothing is placed "
             "here until its worker is heard again")
    if not runs:
        return words
    again = sum(1 for run in runs if _retries_left(snap, run))
    parts = ([f"{again} queued again (retries left)"] if again else []) + \
        ([f"{len(runs) - again} not queued again (no retries left)"] if len(runs) > again else [])
    crashed = "are crashed" if snap.scheduler_heard else "are crashed once an e31 scheduler runs"
    return f"{words}; its {len(runs)} run(s) {crashed}: {', '.join(parts)}"


def fence_words(snap: Any, node: str, now: float, pool_file: str = "POOL.yaml") -> str:
    """What ``e31 queue`` adds to a fenced node's worker column (''
    when no fence names it; ``snap.fences``:
    :attr:`e31.flows.queue.Snapshot.fences`): since when (the earliest
    fence's ``since``, server-clock Unix seconds, said against ``now``), by
    which lost run(s) (job and the first 8 characters of the run id), and
    what lifts it: the runs' processes confirmed gone (by their own flow
    processes, or by the e31 worker started again there), or for a machine
    off for good ``e31 node NODE --pool POOL --down`` (``pool_file``: the
    pool file as the user gave it), after which only that worker lifts it
    (:mod:`e31.tasks.supervisor.fence`)."""
    from e31.flows.placement.text import clock

    fences = sorted((f for f in getattr(snap, "fences", {}).values() if f.get("node") == node),
                    key=lambda f: (f.get("since") or 0, str(f.get("run"))))
    if not fences:
        return ""
    runs = ", ".join(f"{f.get('job')} ({str(f.get('run'))[:8]})" for f in fences)
    many = len(fences) > 1
    head = f"; fenced since {clock(fences[0].get('since') or now, now)} by {runs}, lost there while running"
    if all(f.get("down") for f in fences):
        return (f"{head}, declared down: nothing is placed here until the e31 worker started again there finds "
                f"nothing of {'them' if many else 'it'} left")
    return (f"{head}: nothing is placed here until {'their' if many else 'its'} processes are confirmed gone (by "
            f"{'their flow processes' if many else 'its flow process'}, or by the e31 worker started again there); "
            f"if the machine is off for good: e31 node {node} --pool {pool_file} --down")


def _holdings(snap: Any, node: str) -> list[tuple[str, tuple[int, ...], int, int]]:
    """(run id, GPU devices, CPUs, memory bytes) of each run holding
    ``node``, whatever its worker's liveness: those the snapshot plans with
    (as planned), and those it took for lost with the node, which hold
    what their placement says until they are crashed (their ``placement``
    parameter; their spec's request where it says nothing)."""
    from e31.flows.queue import CPUS_VAR, DEVICES_VAR, NODE_VAR, placement_of

    held = [(r.id, tuple(r.devices), r.cpus, r.memory) for r in snap.running if r.node == node and r.id in snap.runs]
    held += [(r.id, tuple(devices), r.cpus, r.memory) for r in snap.running if r.id in snap.runs  # a gang's members
             for member, devices in getattr(r, "gang", ()) if member == node]
    for key in getattr(snap, "lost", ()):
        run, spec = snap.runs.get(key), getattr(snap, "specs", {}).get(key)
        placed = placement_of(run) if run is not None else {}
        if spec is None or placed.get(NODE_VAR) != node:
            continue
        held.append((key, tuple(int(d) for d in placed.get(DEVICES_VAR) or ()),
                     int(placed.get(CPUS_VAR) or spec.request.cpus), spec.request.memory or 0))
    return held


def node_lines(snap: Any, now: float, pool_file: str = "POOL.yaml") -> list[tuple[str, str, str]]:
    """What ``e31 queue`` says of each node of the pool: (node, what its
    runs hold, its worker).  What its runs hold: GPUs (when it has some),
    CPUs and memory in use of the node's, and how many runs (``GPUs 6/8,
    CPUs 3/16, memory 12 GiB/64 GiB; 2 run(s)``, and ``and 1 handed over
    behind (holding nothing yet)`` for runs waiting behind them:
    ``snap.behind``; a node whose runs hold
    more than it has says so, with what they hold:
    :attr:`e31.flows.queue.Snapshot.overbooked`).  Its worker:
    :func:`worker_words`, then :func:`fence_words` for a fenced node
    (``pool_file``: the pool file as the user gave it)."""
    from e31.flows.placement.text import gib

    rows = []
    for node in snap.nodes:
        held = _holdings(snap, node.name)
        worker = worker_words(snap, node.name, now) + fence_words(snap, node.name, now, pool_file)
        use = [f"CPUs {sum(cpus for _, _, cpus, _ in held)}/{node.cpus}",
               f"memory {gib(sum(memory for _, _, _, memory in held))}/{gib(node.memory)}"]
        if node.gpus:
            use.insert(0, f"GPUs {sum(len(devices) for _, devices, _, _ in held)}/{node.gpus}")
        over = getattr(snap, "overbooked", {}).get(node.name)  # what they hold as they said, not as planned
        behind = sum(1 for ahead in getattr(snap, "behind", {}).values() if any(k == ahead for k, _, _, _ in held))
        runs = f"; {len(held)} run(s)" + (f" and {behind} handed over behind (holding nothing yet)" if behind else "")
        rows.append((node.name, f"more than it has: {over}" if over else ", ".join(use) + runs, worker))
    return rows


def crashed_line(run: Any, retries: int) -> str:
    """What ``e31 queue`` says of a crashed run with retries left, between
    its crash and its requeue (the scheduler's next tick queues it again):
    its attempts so far (Prefect's ``run_count``) of ``retries`` + 1."""
    return (f"crashed ({clip((run.state.message or '').strip(), 80) or 'no message'}); queued again at the "
            f"scheduler's next tick: attempt {(run.run_count or 0) + 1} of {retries + 1}")


def clip(text: str, width: int) -> str:
    """``text`` cut to at most ``width`` characters at a word's end, with ``...`` where it was cut (a
    single word longer than that is cut inside it); whitespace kept as it is."""
    if len(text) <= width:
        return text
    head = text[:max(width - 3, 0)]
    if not (head.endswith(" ") or text[len(head)].isspace()):  # the cut falls inside a word: drop that word
        cut = head.rfind(" ")
        head = head[:cut] if cut > 0 else head
    return head.rstrip(" ,;:") + "..."


def silent_note(snap: Any, node: str | None, now: float) -> str:
    """``; node g's worker is late: last heard 45 s ago`` (``lost`` past the
    lease and its confirmation: :func:`worker_words`) for a run held or
    planned on a node whose worker has been silent past :data:`SILENT_S`
    (what it says may not happen there), else ''."""
    from e31.flows.queue.cache import LOST_CONFIRM_S

    beat = snap.heard.get(node) if node else None
    if node is None or beat is None or now - beat <= SILENT_S:
        return ""
    word = "lost" if now - beat > snap.lease_s + LOST_CONFIRM_S else "late"
    return f"; node {node}'s worker is {word}: last heard {now - beat:.0f} s ago"


#: How many of a pool's runs that ended last ``e31 cancel`` searches for a run id given by its first characters.
PREFIX_LOOKUP = 200


def ended_line(client: Any, pool_name: str, job: str, now: float) -> str:
    """What ``e31 cancel JOB|RUN_ID`` says when ``job`` names no queued or
    running run of pool ``pool_name``: the last run of that name (or the
    run of that full id) of the pool's queue deployment that ended, with
    its final state and end time (``its last run (1f0e2d3c) ended
    Completed at 02:40 UTC: nothing to cancel``), or that the pool has no
    run of that name or id.  A run id given by its first characters (8 or
    more, as ``e31 queue`` shows them) is matched among the
    :data:`PREFIX_LOOKUP` runs of the pool that ended last (the API filters
    by whole ids only).  Two or three API reads."""
    import uuid

    from prefect.client.schemas.filters import (FlowRunFilter, FlowRunFilterDeploymentId, FlowRunFilterId,
                                                FlowRunFilterName, FlowRunFilterState, FlowRunFilterStateType)
    from prefect.client.schemas.sorting import FlowRunSort
    from prefect.exceptions import ObjectNotFound

    from e31.flows.deploy import FLOW_NAME
    from e31.flows.placement.text import clock
    from e31.flows.queue import deployment_name

    try:
        deployment = client.read_deployment_by_name(f"{FLOW_NAME}/{deployment_name(pool_name)}")
    except ObjectNotFound:
        return f"pool {pool_name} has no queue yet (nothing was submitted to it)"
    try:
        by = {"id": FlowRunFilterId(any_=[uuid.UUID(job)])}
    except ValueError:
        by = {"name": FlowRunFilterName(any_=[job])}
    def ended(limit: int, **by: Any) -> list[Any]:
        return client.read_flow_runs(flow_run_filter=FlowRunFilter(
            deployment_id=FlowRunFilterDeploymentId(any_=[deployment.id]),
            state=FlowRunFilterState(type=FlowRunFilterStateType(any_=["COMPLETED", "FAILED", "CANCELLED", "CRASHED"])),
            **by), sort=FlowRunSort.END_TIME_DESC, limit=limit)

    runs = ended(1, **by)
    prefix = "name" in by and len(job) >= 8 and all(c in "0123456789abcdef-" for c in job.lower())
    if not runs and prefix:  # the first characters of a run id
        runs = [r for r in ended(PREFIX_LOOKUP) if str(r.id).startswith(job.lower())][:1]
        by = {"id": None}
    if not runs:
        return (f"no run of {job!r} in pool {pool_name}" + (f" (a run id's first characters are looked up among the "
                                                            f"{PREFIX_LOOKUP} runs that ended last)" if prefix else "") +
                "; e31 queue lists its queued and running jobs")
    run = runs[0]
    ended = run.end_time or (run.state.timestamp if run.state is not None else None)
    when = f" at {clock(ended.timestamp(), now)}" if ended is not None else ""
    what = "its last run" if "name" in by else "the run"
    return f"{what} ({str(run.id)[:8]}) ended {run.state.name if run.state else 'already'}{when}: nothing to cancel"


def print_table(rows: list[tuple[str, ...]]) -> None:
    """Print ``rows`` in aligned columns, the last one left unpadded."""
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]) - 1)]
    for row in rows:
        print("  ".join(str(v).ljust(w) for v, w in zip(row[:-1], widths)) + "  " + row[-1])
