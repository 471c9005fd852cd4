"""The Prefect tasks of an E31 job, and what serves them.

The four tasks, one module each:

| task | module | what it does |
|---|---|---|
| ``stage-<input>`` | :mod:`e31.tasks.stage` | list every input, copy it to compute-local scratch, verify it |
| ``run`` | :mod:`e31.tasks.run` | run the work in a supervised child process until it ends or must stop |
| ``checkpoint-step-<N>`` | :mod:`e31.tasks.checkpoint` | make a committed local checkpoint durable (upload, verify, prune) |
| ``return`` | :mod:`e31.tasks.deliver` | publish the output files and ``manifest.json`` at ``output.url`` |

What they share: :mod:`.outcome` (how a run ended), :mod:`.manifest` (the
verdict and the manifest), :mod:`.manifest_model` (the manifest's typed form,
which every reader imports; docs/manifest.md is generated from it by
:mod:`.manifest_doc`), :mod:`.pending` (a return kept for ``e31 return``),
:mod:`.settings` (``E31_*`` tuning variables), :mod:`.retrying` (Prefect retry
conditions).

Subpackages:

- :mod:`e31.tasks.storage` -- the one fsspec layer (filesystems, publish, listing,
  transfer, credentials, masking);
- :mod:`e31.tasks.work` -- the work's side of a run, inside the child process
  (its context object, the entry point, the local checkpoint format);
- :mod:`e31.tasks.supervisor` -- the run task's helpers in the flow's process
  (process control, cancel watching, progress, checkpoint uploads, the work's output).

Layers: ``tasks`` imports ``specs``, never ``flows``.
"""
