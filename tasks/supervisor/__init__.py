"""Helpers of the run task, in the flow's process, around the work's child.

- :mod:`.process` -- child process control (die with the parent, deferred signals);
- :mod:`.cancel` -- notice a cancel of the flow run made through the Prefect API;
- :mod:`.progress` -- show the work's ``ctx.progress`` (terminal, log, artifact);
- :mod:`.uploader` -- hand each new committed checkpoint to the checkpoint task.
"""
