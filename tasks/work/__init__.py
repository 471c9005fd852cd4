"""The work's side of a run, inside the child process.

- :mod:`.context` -- :class:`~e31.tasks.work.context.WorkContext`, the object a
  Python entrypoint receives, and the environment a command gets;
- :mod:`.child` -- ``python -m e31.tasks.work.child CONFIG``: load the entrypoint, call it;
- :mod:`.local_checkpoints` -- the local checkpoint format (``step-<N>/`` with a
  ``COMMITTED`` marker written last);
- :mod:`.handoff` -- the fast hand-over of a checkpoint's tensors to the supervisor.
"""
