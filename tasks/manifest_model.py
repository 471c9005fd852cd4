"""The manifest's typed form: what ``manifest.json`` holds, field by field.

Two shapes share the file name at a destination (:mod:`e31.tasks.destination`):
a final :class:`Manifest` (``status`` completed, partial or failed: the
files beside it are one run's output) and a :class:`ReturningNote`
(``status: returning``: a return is in progress).  :func:`parse_manifest`
reads either from the JSON-decoded dict; :meth:`Manifest.to_json_dict` gives
the dict that is written, key for key as listed here (docs/manifest.md is
generated from these classes: ``python -m e31.tasks.manifest_doc``).

Imports nothing of E31, so that every reader (tasks/, flows/,
deployments/, e31/) may import it.
"""

from __future__ import annotations

from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

#: A final manifest's ``status``: whether the files beside it are the job's whole output.
Status = Literal["completed", "partial", "failed"]
#: How the run ended (``reason``).
Reason = Literal["finished", "time_limit", "deadline", "cancelled", "preempted", "signal", "crashed", "error",
                 "out_of_memory"]
#: ``folder``: where the run's files are, relative to ``output.url``.
Folder = Literal[".", "partial"]

STATUSES: tuple[str, ...] = get_args(Status)
REASONS: tuple[str, ...] = get_args(Reason)

#: What each ``status`` means (docs/manifest.md).
STATUS_MEANING: dict[str, str] = {
    "completed": "the work finished and wrote every declared output file; the files are at the top of `output.url`",
    "partial": "the run stopped before the work's end (see `reason`); what it wrote is in `partial/`",
    "failed": "the work failed or could not run (see `reason` and `message`); what it wrote is in `partial/`",
    "returning": "a return is in progress (a `ReturningNote`): the files may be from two runs; wait for a final "
                 "manifest",
}
#: What each ``reason`` means (docs/manifest.md).
REASON_MEANING: dict[str, str] = {
    "finished": "the work exited 0 (status `completed`)",
    "time_limit": "stopped at its time limit (`request.limit`): SIGTERM `request.grace` before it, SIGKILL at it "
                  "if the work is still running (status `partial`)",
    "deadline": "stopped before its deadline (`request.deadline`, `deadline_within` or `deadline_at`) early enough "
                "to return its output: SIGKILL at the deadline less the return reserve, SIGTERM `request.grace` "
                "before that (status `partial`)",
    "cancelled": "the flow run was cancelled (status `partial`)",
    "preempted": "the queue stopped the run for a job with priority over it (`request.preemptible`); the run is "
                 "queued again and resumes from its newest checkpoint (status `partial`)",
    "signal": "the run's process got SIGTERM or SIGINT (status `partial`)",
    "crashed": "the work process was killed outside E31, or an earlier attempt's process died (status `partial`)",
    "error": "the work exited non-zero, did not write a declared file, wrote a file that may not leave the job, or "
             "an input could not be staged (status `failed`)",
    "out_of_memory": "the work used more memory than `request.memory` (status `failed`)",
}


class _Part(BaseModel):
    """Read leniently (unknown keys ignored: a newer E31's manifest stays readable), never mutated."""

    model_config = ConfigDict(extra="ignore", frozen=True)


class ManifestFile(_Part):
    """One returned file."""

    path: str = Field(description="Path relative to the manifest's folder, `/`-separated.")
    bytes: int = Field(description="Size in bytes, as verified at the destination.")
    sha256: str = Field(description="Hex SHA-256 of the file's bytes.")


class Meter(_Part):
    """What the run is billed: the request's GPUs and CPUs times the seconds from the work's start to the release.

    See docs/output.md, "The meter", and :func:`e31.tasks.meter.meter`.  Numbers keep their JSON type (``float | int``): a value written as ``1000`` stays ``1000``."""

    started_at: float | int | None = Field(description="Unix seconds (ms) the work started; null when no work started.")
    released_at: float | int | None = Field(description="Unix seconds (ms) the output was returned; null when no work "
                                                  "started.")
    seconds: float | int = Field(description="`released_at - started_at`, ms; 0.0 when no work started.")
    gpu_seconds: float | int = Field(description="`request.gpus` x `seconds`, ms.")
    cpu_seconds: float | int = Field(description="`request.cpus` x `seconds`, ms.")


class Logs(_Part):
    """The work's last output lines (secrets masked)."""

    stdout_tail: str = Field(description="The work's last stdout lines.")
    stderr_tail: str = Field(description="The work's last stderr lines.")
    lines_not_forwarded: int = Field(description="Lines of output not forwarded to the run's log (rate-limited).")


#: What a manifest an earlier E31 wrote lacks, read as (the fields added since; ``folder``
#: follows from ``status``).  This E31 writes every field.
EARLIER_DEFAULTS: dict[str, Any] = {
    "attempt": None, "tenant": None, "message": "", "exit_code": None, "step": None, "resumed_from_step": None, "preemptions": 0,
    "lost_s": 0.0, "stale": [],
    "checkpoint": None, "timings": {}, "staged_before_allocation": None, "peak_memory_bytes": 0, "spec_sha256": "",
    "finished_at": "", "stop_requested_at": None, "logs": {"stdout_tail": "", "stderr_tail": "", "lines_not_forwarded": 0},
}
#: The same for a manifest's ``meter``.
EARLIER_METER: dict[str, Any] = {"started_at": None, "released_at": None, "seconds": 0.0, "gpu_seconds": 0.0,
                                 "cpu_seconds": 0.0}


class Manifest(_Part):
    """A final manifest: one run's verdict and the files beside it.

    Read, a manifest an earlier E31 wrote is still the word on its folder (its files are not
    taken for stale ones, its completion still counts): a field it lacks reads as
    :data:`EARLIER_DEFAULTS` says; ``job``, ``run_id``, ``status``, ``reason`` and ``files`` are
    required."""

    @model_validator(mode="before")
    @classmethod
    def _earlier_e31(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        filled = {**EARLIER_DEFAULTS, **data}
        if "folder" not in data and "status" in data:
            filled["folder"] = "." if data["status"] == "completed" else "partial"
        if isinstance(data.get("meter", {}), dict):
            filled["meter"] = {**EARLIER_METER, **data.get("meter", {})}
        return filled

    job: str = Field(description="The job's `name`.")
    run_id: str | None = Field(description="The Prefect flow run id; null when run outside a flow run.")
    attempt: str | None = Field(description="A token of the flow process that made this attempt of the run (a run "
                                            "queued again after its node was lost keeps its flow run id); null when "
                                            "not known.")
    tenant: str | None = Field(description="The pool's tenant the run was submitted for (its flow run's tag "
                                           "`tenant:NAME`); null outside a queue.")
    status: Status = Field(description="The verdict (see [status](#status)).")
    reason: Reason = Field(description="How the run ended (see [reason](#reason)).")
    message: str = Field(description="A line for a person; empty for a plain completion.")
    exit_code: int | None = Field(description="The work's exit code (negative: killed by that signal); null when "
                                              "the work did not run.")
    step: int | None = Field(description="The step of the newest checkpoint returned; null when none.")
    resumed_from_step: int | None = Field(description="The checkpoint step the work resumed from; null for a fresh "
                                                      "start.")
    preemptions: int = Field(description="How many times the queue has preempted this flow run so far (this stop "
                                         "included when its reason is `preempted`); each time it was queued again "
                                         "and resumed.")
    lost_s: float = Field(description="Seconds of work those preemptions threw away: for each, from its newest "
                                      "durable checkpoint (or its work's start) to the stop; the work redone.")
    folder: Folder = Field(description="Where the files are, relative to `output.url`: `.` for `completed`, "
                                       "`partial` otherwise.")
    files: list[ManifestFile] = Field(description="The returned files, relative to `folder`.")
    stale: list[str] = Field(description="Other files found beside the manifest that no E31 run of the job wrote "
                                         "(left in place, not part of the output).")
    checkpoint: str | None = Field(description="The durable checkpoint's URL (secrets masked); null when none.")
    timings: dict[str, float] = Field(description="Seconds (ms), in this order when present: `prefetch_s` (staged "
                                                  "by the node's prefetcher before the allocation), `staging_s`, "
                                                  "`run_s`, the run's phases `child_start_s`, `work_s`, `settle_s`, "
                                                  "`handover_staging_s` and `handover_wait_s` (a run handed over "
                                                  "behind another on its node), `prestart_s` (how long a Python entrypoint's child "
                                                  "had been loading while the inputs staged), `return_s`.")
    meter: Meter = Field(description="What the run is billed: the work's start to the release.")
    staged_before_allocation: bool | None = Field(description="True when every input was found staged and unchanged "
                                                              "at the run's start; false when one was copied in the "
                                                              "run; null when the job reads no data.")
    peak_memory_bytes: int = Field(description="The work's peak memory seen, in bytes (0: not measured).")
    spec_sha256: str = Field(description="SHA-256 of the job's spec as run.")
    finished_at: str = Field(description="ISO 8601 UTC time the manifest was made, to the second.")
    stop_requested_at: float | int | None = Field(description="Unix seconds the work was warned to stop; null when no "
                                                        "stop was asked.")
    logs: Logs = Field(description="The work's last output lines.")
    stderr_tail: str | None = Field(default=None, description="Only in a `failed` manifest with stderr output: "
                                                              "`logs.stderr_tail` again; absent otherwise.")

    def to_json_dict(self) -> dict[str, Any]:
        """The dict written to ``manifest.json`` (``json.dumps(d, indent=2)``):
        every field in declaration order, nulls written as null, except
        ``stderr_tail``, absent unless set."""
        return self.model_dump(mode="python", exclude={"stderr_tail"} if self.stderr_tail is None else set())


class ReturningNote(_Part):
    """The manifest while a return is in progress: written first, replaced by a final manifest last."""

    job: str = Field(description="The job's `name`.")
    run_id: str | None = Field(description="The flow run id of the run returning; null outside a flow run.")
    status: Literal["returning"] = Field(description="Always `returning`.")
    message: str = Field(description="Says that the files may be from two runs.")
    writing: list[str] = Field(description="The files this return writes, relative to the folder.")
    written_before: list[str] = Field(description="The files the folder's previous manifest listed (E31's own, "
                                                  "removed or replaced by this return).")
    started_at: str = Field(description="ISO 8601 UTC time the return started, to the second.")

    def to_json_dict(self) -> dict[str, Any]:
        """The dict written to ``manifest.json``, every field in declaration order."""
        return self.model_dump(mode="python")


class ManifestHead(_Part):
    """The few keys a Prefect state or a message is worded from, each optional: read from any
    manifest-shaped dict (a final manifest, a returning note, or the parts of one a caller kept)."""

    job: str | None = Field(default=None, description="The job's `name`.")
    run_id: str | None = Field(default=None, description="The flow run id.")
    status: Status | Literal["returning"] | None = Field(default=None, description="The verdict, or `returning`.")
    reason: Reason | None = Field(default=None, description="How the run ended.")
    message: str | None = Field(default=None, description="A line for a person.")
    folder: str | None = Field(default=None, description="Where the files are, relative to `output.url`.")
    files: list[Any] | None = Field(default=None, description="The returned files (only counted here).")

    @classmethod
    def of(cls, manifest: dict[str, Any] | Manifest | ReturningNote) -> ManifestHead:
        """The head of ``manifest``; every key None when one of them does not
        fit its type (a hand-edited file)."""
        data = manifest.to_json_dict() if isinstance(manifest, (Manifest, ReturningNote)) else manifest
        try:
            return cls.model_validate(data)
        except ValidationError:
            return cls()


def parse_manifest(data: Any) -> Manifest | ReturningNote | None:
    """A manifest's decoded JSON as :class:`Manifest` (``status`` completed,
    partial, failed) or :class:`ReturningNote` (``returning``); None when
    ``data`` is None or not a valid manifest of either shape (hand-edited,
    from a foreign tool): a reader treats it as it treats a missing or
    truncated file, as no manifest."""
    if isinstance(data, (Manifest, ReturningNote)):
        return data
    if not isinstance(data, dict):
        return None
    try:
        if data.get("status") == "returning":
            return ReturningNote.model_validate(data)
        return Manifest.model_validate(data)
    except ValidationError:
        return None
