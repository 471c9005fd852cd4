"""The live queue's one door to the Prefect API: submit jobs, read the pool's
flow runs as planner input, and record the planner's decisions on them.

How a queue maps onto Prefect (nothing else holds queue state):

- a pool file's pool is a Prefect **work pool** of type ``e31`` named after
  it, served by ``e31 worker`` processes (one per node);
- a submitted job is a **flow run** of ``run_job`` (deployment
  ``e31-job/queue-<pool>``), created ``Scheduled`` with the state name
  ``Queued``; runs of any other deployment on the work pool (``e31 deploy
  --cron``) join the queue when their scheduled time comes;
- a waiting run's state message is the planner's reason, and its scheduled
  time the planned start (so the UI shows both, and the run never turns
  ``Late``); the message is words for a person, never read back;
- the flow run parameter ``placement`` holds the typed placement record
  (:class:`e31.tasks.placement_record.PlacementRecord`, its one codec): a
  waiting run with a reserved start has its node there (``e31_planned``,
  :func:`.mapping.planned_start`): that node's worker prefetches its inputs;
- a placed run gets its node, GPU devices and CPUs in ``placement``
  (``e31_node``, ``gpu_devices``, ``cpus``), the tag ``e31-placed:<node>``
  (:func:`.mapping.placed_on`: the server's events carry tags, so only that
  node's worker wakes) and the state ``Scheduled`` named ``Placed`` at the
  current time: only the ``e31 worker`` of that node takes it;
- ``Pending``/``Running``/``Cancelling`` runs, and ``Placed`` ones, hold their
  resources until their state is final (the output returned);
- a run handed over behind a running one (``placement`` ``e31_after``,
  :data:`.mapping.HANDOVER_S`) is placed shortly before that run's planned
  end: its flow process starts and stages, and its work waits until the
  run ahead has ended (:mod:`.handover`); until then the run ahead holds
  the resources for both;
- a refused run ends ``Failed`` with the reason.

Everything here is a plain function of a Prefect client; the policy is in
:mod:`e31.flows.placement` (no Prefect import).

The modules: :mod:`.mapping` (names and the placement's keys), :mod:`.submit`
(the work pool, its deployment, a queued run), :mod:`.cache` (the pool's
active runs kept between the scheduler's ticks: what changed is read, not
every run), :mod:`.snapshot` (reading the runs as planner input),
:mod:`.record` (writing the plan back).
"""

from e31.flows.queue.cache import RunCache
from e31.flows.queue.mapping import (AFTER_VAR, AHEAD_S, ATTEMPT_VAR, CPUS_VAR, DEVICES_VAR, DOWN, HANDOVER_S, LEASE_S,
                                     NODE_VAR, PLACED, PLACEMENT_PARAM, QUEUED, SETTLE_S, STAGED, STAGED_ON,
                                     STAGING_S, WORKER_TYPE, deployment_name, inputs_key, nodes_of, placement_of,
                                     PlacementRecord, PlannedStart, placed_on, planned_node, planned_start,
                                     record_of, staged_tags, work_pool_name)
from e31.flows.queue.record import apply, handover_lead, humane, refuse_at_destination
from e31.flows.queue.snapshot import Snapshot, live_nodes, read
from e31.flows.queue.submit import ensure_pool, submit

__all__ = ["AFTER_VAR", "AHEAD_S", "ATTEMPT_VAR", "CPUS_VAR", "DEVICES_VAR", "DOWN", "HANDOVER_S", "LEASE_S", "NODE_VAR",
           "PLACED", "PLACEMENT_PARAM", "QUEUED", "SETTLE_S", "STAGED", "STAGED_ON", "STAGING_S", "WORKER_TYPE",
           "RunCache", "Snapshot", "apply", "deployment_name", "ensure_pool", "handover_lead", "humane", "inputs_key",
           "PlacementRecord", "PlannedStart", "live_nodes", "nodes_of", "placed_on", "placement_of",
           "planned_node", "planned_start", "record_of", "read", "refuse_at_destination", "staged_tags",
           "submit", "work_pool_name"]
