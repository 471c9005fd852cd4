"""The E31 worker's job configuration and work-pool variables: a flow run's
placement (node, GPU devices, CPUs, the runs it waits behind) into the flow
process's configuration and environment (:class:`E31JobConfiguration`), and
the variables a work pool of type ``e31`` declares (:class:`E31Variables`)."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from prefect.workers.process import ProcessJobConfiguration, ProcessVariables

from e31.deployments.warmstart import FLOW_PROCESS_SETTINGS, flow_process_command
from e31.flows.deploy import ENTRYPOINT
from e31.flows.queue import CPUS_VAR, DEVICES_VAR, NODE_VAR, placement_of
from e31.flows.queue.handover import AFTER_ENV
from e31.tasks.placement_record import PlacementRecord

#: The settings object a worker's flow processes' base environment was computed for, and that environment.
_SETTINGS_ENV: list[tuple[Any, dict[str, str]]] = []


class E31JobConfiguration(ProcessJobConfiguration):
    """A process job placed by the E31 scheduler: its node and devices."""

    e31_node: str | None = Field(default=None)
    gpu_devices: list[int] = Field(default_factory=list)
    cpus: int | None = Field(default=None)
    e31_after: str | None = Field(default=None)

    @classmethod
    def _base_environment(cls) -> dict[str, str]:
        """Prefect's environment for every flow process (each setting that is
        set, as an environment variable, and
        :data:`e31.deployments.warmstart.FLOW_PROCESS_SETTINGS` unless set),
        computed once per settings object in force rather than for every run:
        Prefect serializes all its settings each time, which py-spy found at
        3.5 % of the CPU of a worker and its flow processes under bench_queue
        (3 s jobs)."""
        from prefect.settings import get_current_settings

        settings = get_current_settings()
        if not _SETTINGS_ENV or _SETTINGS_ENV[0][0] is not settings:
            _SETTINGS_ENV[:] = [(settings, {**FLOW_PROCESS_SETTINGS, **super()._base_environment()})]
        return dict(_SETTINGS_ENV[0][1])

    def prepare_for_flow_run(self, flow_run: Any, deployment: Any = None, flow: Any = None, work_pool: Any = None,
                             worker_name: str | None = None, worker_id: Any = None) -> None:
        """Prefect's preparation, then the run's placement
        (:func:`e31.flows.queue.placement_of`: its ``placement`` parameter;
        without one, the job variables) into this configuration and the flow
        process's environment: ``CUDA_VISIBLE_DEVICES`` and
        ``E31_GPU_DEVICES`` (the placed devices, e.g. ``4,5``; empty for a CPU
        job) and ``E31_NODE``; for a run handed over behind another, or placed
        by preempting others, ``E31_AFTER`` (the ids of the runs its work
        waits for, comma-separated: :mod:`e31.flows.queue.handover`)."""
        configured = self.command is not None
        super().prepare_for_flow_run(flow_run, deployment, flow, work_pool, worker_name, worker_id=worker_id)
        placed = placement_of(flow_run)
        if placed.get(NODE_VAR):  # the placement whole (an older one's e31_after does not outlive it)
            self.e31_node = placed[NODE_VAR]
            self.e31_after = ",".join(PlacementRecord.from_parameter(placed).waits_for()) or None
            self.gpu_devices = [int(d) for d in placed.get(DEVICES_VAR) or ()]
            self.cpus = placed.get(CPUS_VAR) or self.cpus
        devices = ",".join(str(d) for d in self.gpu_devices)
        self.env = {**self.env, "CUDA_VISIBLE_DEVICES": devices, "E31_GPU_DEVICES": devices,
                    "E31_NODE": self.e31_node or ""}
        if self.e31_after:
            self.env[AFTER_ENV] = str(self.e31_after)
        if configured or getattr(deployment, "entrypoint", None) != ENTRYPOINT:
            return
        # E31's flow: loaded by its module path (no deployment read, no pull step), in one process
        # started by Prefect's engine command starter, forked from the warm process when there is one
        self.env["PREFECT__FLOW_ENTRYPOINT"] = ENTRYPOINT
        self.command = flow_process_command()
        self._command_configured = True



class E31Variables(ProcessVariables):
    """The work pool's variables.  The E31 scheduler writes a run's
    placement into its ``placement`` parameter, not these (a cheaper write:
    :data:`e31.tasks.supervisor.fence.PLACEMENT_PARAM`); a run without that
    parameter is placed by these, set by hand or by an E31 before December
    2026."""

    e31_node: str | None = Field(default=None, description="Node the E31 scheduler placed the run on "
                                                           "(set by the scheduler; a worker runs only its node's).")
    gpu_devices: list[int] = Field(default_factory=list, description="GPU device numbers of the placement on the "
                                                                     "node; the work sees exactly these.")
    cpus: int | None = Field(default=None, description="CPUs of the placement (the job's request.cpus).")
    e31_planned_node: str | None = Field(default=None, description="Unused: a waiting run's planned node is in its "
                                                                   "placement parameter (kept for older pools).")
    e31_after: str | None = Field(default=None, description="Flow run a handed-over run waits behind (set by the "
                                                            "scheduler): its work starts once that run has ended.")
