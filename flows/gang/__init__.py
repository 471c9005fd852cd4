"""One run across several nodes (a gang): the lead's flow process and a member process per other node.

A multi-node job is one flow run.  The scheduler places it on N nodes at once
(:class:`e31.tasks.placement_record.PlacementRecord`: ``node`` is the lead, rank 0; ``gang`` the others, in
rank order) and tags it ``e31-member:NODE`` for each other node.  Then:

1. The lead node's ``e31 worker`` starts the flow process, as for any run: it stages the inputs, resumes
   from the newest checkpoint and, just before its work starts, publishes the rendezvous on the flow run
   (:mod:`e31.flows.gang.rendezvous`: its address, a free port, the attempt, the step it resumes from, the
   stop time).
2. Each other node's ``e31 worker`` sees the run (its ``e31-member:`` tag, the run ``Pending`` or
   ``Running``) and starts ``python -m e31.flows.gang.member RUN_ID`` (:mod:`e31.deployments.members`): the
   member stages the inputs on its own scratch, fetches the checkpoint the lead resumes from, waits for the
   rendezvous of this attempt and runs the work as rank 1, 2, ... (``RANK``, ``WORLD_SIZE``,
   ``MASTER_ADDR``, ``MASTER_PORT``: :mod:`e31.tasks.work.rendezvous`).
3. The lead's output is the job's output; a member's output folder and checkpoints stay on its node (a
   data-parallel work holds the same state on every rank, and rank 0's checkpoints are the job's).
4. A member stops its work (SIGTERM, then SIGKILL ``grace`` later) at the published stop time, and as soon
   as the run leaves ``Running`` or another attempt begins; its end is written back on the run
   (:func:`e31.flows.gang.rendezvous.report_member`).  A rank whose peer died sees its next collective fail.
"""
