"""The job spec models: a job declares work, data, a resource request and an output."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import timedelta
from typing import Any, Literal

from pydantic import Field, StrictBool, StrictInt, ValidationError, field_validator

from .base import RuleError, SpecModel, spec_error
from .deadlines import DeadlineAt
from .fields import (Deadline, Duration, FileName, GpuType, Grace, InputName, JobName, Memory, Sha256, Url,
                     check_entrypoint, check_json, file_key)
from .input_names import input_name_problems
from .live import LIVE_KEYS, LIVE_REASON, find_live_keys, got_key, live_kind, live_message
from .output_urls import OutputUrl, overlap_problems
from .storage_options import OPTIONS_HELP, StorageOptions
from .units import format_duration, parse_duration

__all__ = ["CheckpointPolicy", "DataInput", "JobSpec", "OutputSpec", "RequestSpec", "WorkSpec"]

WorkKind = Literal["training", "inference", "processing", "simulation"]
OutputKind = Literal["model", "results", "files", "report"]


def _given(data: Mapping[str, Any], key: str) -> bool:
    return data.get(key) is not None


def _try_duration(value: Any) -> timedelta | None:
    try:
        return parse_duration(value)
    except ValueError:
        return None


class WorkSpec(SpecModel):
    """What runs: a Python callable ``module:function`` or a command, exactly one of the two.

    Raises (on validation) :class:`SpecError`: both or neither of
    entrypoint/command, a malformed entrypoint, an empty command, or live work
    (kind ``service``, ``daemon``..., or keys ``port``, ``latency``... anywhere
    under work, params included).
    """

    live_keys_refused = True

    kind: WorkKind = Field(description="training, inference, processing or simulation.")
    entrypoint: str | None = Field(None, description="Python callable 'module:function', e.g. e31.examples.digits:train.")
    command: list[str] | None = Field(None, min_length=1,
                                      description="Program and arguments, e.g. [python, train.py, --epochs, '20'].")
    params: dict[str, Any] = Field(default_factory=dict, description="Parameters passed to the work.")

    @field_validator("kind", mode="before")
    @classmethod
    def _not_live(cls, value: Any) -> Any:
        what = live_kind(value)
        if what:
            raise spec_error(live_message(what), fix=LIVE_REASON)
        return value

    @field_validator("entrypoint")
    @classmethod
    def _entrypoint(cls, value: str | None) -> str | None:
        return None if value is None else check_entrypoint(value)

    @field_validator("command", mode="before")
    @classmethod
    def _command(cls, value: Any) -> Any:
        if isinstance(value, str):
            fix = f"write it as a list, e.g. [{', '.join(value.split())}]"
            raise spec_error("must be a list of program and arguments", fix=fix)
        if isinstance(value, list) and not value:
            raise spec_error("must be a non-empty list of program and arguments", fix="e.g. [python, train.py]")
        return value

    @field_validator("params", mode="before")
    @classmethod
    def _params_none(cls, value: Any) -> Any:
        return {} if value is None else value  # "params:" with nothing under it

    @field_validator("params")
    @classmethod
    def _params(cls, value: dict[str, Any]) -> dict[str, Any]:
        check_json(value)
        found = find_live_keys(value)
        if found:
            raise ValidationError.from_exception_data("params", [
                {"type": spec_error(live_message(LIVE_KEYS[key.lower()]), fix=LIVE_REASON,
                                    got=got_key(key, val)), "loc": loc, "input": val}
                for loc, key, val in found
            ])
        return value

    @classmethod
    def _rules(cls, data: Mapping[str, Any]) -> list[RuleError]:
        has_entry, has_command = _given(data, "entrypoint"), _given(data, "command")
        if has_entry and has_command:
            err = spec_error(
                "exactly one of 'entrypoint' or 'command' is required",
                fix="keep entrypoint for a Python callable or command for a program, not both",
                got="both",
            )
        elif not (has_entry or has_command):
            err = spec_error(
                "exactly one of 'entrypoint' or 'command' is required",
                fix="add entrypoint: module:function for a Python callable, or command: [program, arg, ...]",
                got="neither",
            )
        else:
            return []
        return [((), err, dict(data))]


class DataInput(SpecModel):
    """One input staged before the run, to a folder named ``name``; verified if ``sha256`` is given.

    Raises (on validation) :class:`SpecError`: an unsafe name, an empty
    url, a sha256 that is not 64 hex characters, or bad ``storage_options``
    (e31.specs.storage_options). Names must be unique within JobSpec.data.
    """

    name: InputName = Field(description="Input name, unique in the job; becomes a folder name.")
    url: Url = Field(description="fsspec URL or path; a relative path is relative to the spec file.")
    sha256: Sha256 | None = Field(None, description="Expected SHA-256 of the file (64 hex chars).")
    storage_options: StorageOptions = Field(default_factory=dict, description=OPTIONS_HELP)


class RequestSpec(SpecModel):
    """Resources and time: GPUs, CPUs, memory (BYTES), durations (timedelta, seconds), deadlines.

    At least one of ``duration`` and ``limit``; ``duration <= limit``; ``grace`` (the time from
    the stop warning, SIGTERM, to the hard kill) shorter than the limit.  One kind of deadline:
    ``deadline`` (absolute, with timezone, in the future), ``deadline_within`` (after each run's
    scheduled start) or ``deadline_at`` (a time of day in a timezone).  Raises (on validation)
    :class:`SpecError` for these rules, bad values, or live-work keys (``port``, ``latency``).
    """

    live_keys_refused = True

    nodes: StrictInt = Field(1, ge=1, le=1024, description="Nodes (machines) started together, a gang: the rest is per node.")
    gpus: StrictInt = Field(0, ge=0, le=1024, description="Number of GPUs per node (whole devices).")
    gpu_type: GpuType | None = Field(None, description="Run only on nodes with this GPU model, e.g. H100.")
    cpus: StrictInt = Field(1, ge=1, le=65536, description="Number of CPU cores per node.")
    memory: Memory | None = Field(None, description="Memory per node in bytes, or a size such as 4GiB, 512MB.")
    duration: Duration | None = Field(None, description="Expected run time, e.g. 10m, 04:00:00, PT4H, or seconds.")
    limit: Duration | None = Field(None, description="Hard stop after this run time, e.g. 30m, or seconds.")
    deadline: Deadline | None = Field(None, description="Finish-by time, ISO 8601 with a timezone.")
    deadline_within: Duration | None = Field(None, description="Finish within this of each run's scheduled start, e.g. 4h.")
    deadline_at: DeadlineAt | None = Field(None, description='Finish by this time of day, e.g. "06:00 Europe/London".')
    grace: Grace = Field(
        timedelta(seconds=10), description="Time between the stop warning (SIGTERM) and the hard kill, e.g. 10s."
    )
    retries: StrictInt = Field(0, ge=0, le=100, description="How many times a failed run is retried.")
    preemptible: StrictBool | None = Field(None, description=(
        "May a queue stop it for a job with priority over it (it returns a partial output, waits again and resumes "
        "from its newest checkpoint). Default: true with output.checkpoint.every/every_steps and no deadline."))

    @classmethod
    def _rules(cls, data: Mapping[str, Any]) -> list[RuleError]:
        if not (_given(data, "duration") or _given(data, "limit")):
            err = spec_error("at least one of 'duration' (expected run time) or 'limit' (hard stop) is required",
                             fix="add e.g. limit: 30m", got="neither")
            return [((), err, dict(data))]
        duration, limit = _try_duration(data.get("duration")), _try_duration(data.get("limit"))
        if duration is not None and limit is not None and duration > limit:
            err = spec_error(
                "must be <= limit",
                fix="raise limit or lower duration",
                got=f"duration {format_duration(duration)} > limit {format_duration(limit)}",
            )
            return [(("duration",), err, data.get("duration"))]
        grace = _try_duration(data.get("grace")) if _given(data, "grace") else timedelta(seconds=10)
        stop = limit if _given(data, "limit") else duration  # an unreadable limit has its own problem
        if grace is not None and stop is not None and stop > timedelta(0) and grace >= stop:
            err = spec_error(
                "must be shorter than the time limit: the stop warning comes grace before the hard stop",
                fix="lower grace or raise limit",
                got=f"grace {format_duration(grace)} >= limit {format_duration(stop)}",
            )
            return [(("grace",), err, data.get("grace"))]
        kinds = [k for k in ("deadline", "deadline_within", "deadline_at") if _given(data, k)]
        err = spec_error("give one kind of deadline", fix="keep one of deadline, deadline_within, deadline_at",
                         got=" and ".join(kinds))
        return [((kinds[1],), err, data.get(kinds[1]))] if len(kinds) > 1 else []


class CheckpointPolicy(SpecModel):
    """How often the work checkpoints (``every`` a duration, or ``every_steps``) and how many to keep.

    ``url`` is the durable checkpoint location (None: the flow's default); ``storage_options`` its fsspec options.
    Raises (on validation) :class:`SpecError` when both ``every`` and
    ``every_steps`` are set, a count is below 1, or ``url`` cannot be written to
    (no bucket or host, a glob character: :mod:`e31.specs.output_urls`).
    """

    every: Duration | None = Field(None, description="Checkpoint at least this often, e.g. 2m.")
    every_steps: StrictInt | None = Field(None, ge=1, le=10**12, description="Checkpoint every N steps.")
    keep: StrictInt = Field(3, ge=1, le=1000, description="How many durable checkpoints to keep.")
    url: OutputUrl | None = Field(None, description="Durable checkpoint folder (step-<N> only); default <output.url>/checkpoints.")
    storage_options: StorageOptions = Field(default_factory=dict, description=OPTIONS_HELP)

    @classmethod
    def _rules(cls, data: Mapping[str, Any]) -> list[RuleError]:
        if _given(data, "every") and _given(data, "every_steps"):
            err = spec_error(
                "set 'every' (a duration) or 'every_steps' (a step count), not both",
                fix="keep one", got="both",
            )
            return [((), err, dict(data))]
        return []


class OutputSpec(SpecModel):
    """Where results go and which files mark the job complete.

    Raises (on validation) :class:`SpecError`: no files, duplicate
    files, a file that is absolute, contains ``..`` or is not a POSIX path, or
    a ``url`` that cannot be written to (no bucket or host, a glob character).
    """

    kind: OutputKind = Field(description="model, results, files or report.")
    url: OutputUrl = Field(description="Destination fsspec URL or path; relative to the spec file.")
    files: list[FileName] = Field(
        description="Relative POSIX paths of the files whose existence marks the job complete."
    )
    storage_options: StorageOptions = Field(default_factory=dict, description=OPTIONS_HELP)
    checkpoint: CheckpointPolicy = Field(
        default_factory=CheckpointPolicy, title="Checkpoint", description="Checkpoint policy."
    )

    @field_validator("files", mode="before")
    @classmethod
    def _some_files(cls, value: Any) -> Any:
        if isinstance(value, list) and not value:
            raise spec_error(
                "must list at least one file",
                fix="list the files whose existence marks the job complete, e.g. [model.pt, metrics.json]",
            )
        return value

    @classmethod
    def _rules(cls, data: Mapping[str, Any]) -> list[RuleError]:
        files = data.get("files")
        if not isinstance(files, list):
            return []
        seen: dict[str, int] = {}
        problems: list[RuleError] = []
        for index, item in enumerate(files):
            key = file_key(item)
            if key is None:
                continue
            if key in seen:
                err = spec_error(f"duplicate of files[{seen[key]}]", fix="list each file once")
                problems.append((("files", index), err, item))
            else:
                seen[key] = index
            checkpoint = data.get("checkpoint")
            own_checkpoints = not (isinstance(checkpoint, Mapping) and checkpoint.get("url"))
            if own_checkpoints and key.split("/", 1)[0] == "checkpoints":
                err = spec_error("checkpoints/ in the output holds E31's durable checkpoints, which are replaced "
                                 "as a run goes on", fix="give the work's file a path outside it, e.g. final/model.pt, "
                                 "or set output.checkpoint.url to another folder")
                problems.append((("files", index), err, item))
        return problems


class JobSpec(SpecModel):
    """A batch job: work, data, request and output (see docs/design.md, section 1).

    Build it from Python (``JobSpec(name=..., work=..., request=..., output=...)``,
    ``JobSpec.model_validate(mapping)``) or load it with :func:`e31.specs.load_spec`;
    both raise :class:`e31.specs.SpecError` with the same problem lines (source
    ``<spec>`` from Python), every problem at once. (Nested in another pydantic
    model, e.g. as a Prefect flow parameter, it raises pydantic's ValidationError.)
    Across sections: input names must be unique (:mod:`e31.specs.input_names`), and
    ``output.url`` and ``output.checkpoint.url`` must not be, lie inside, or
    hold a ``data[].url`` (:mod:`e31.specs.output_urls`).
    """

    live_keys_refused = True

    spec_version: Literal[1] = Field(1, description="Spec format version; 1.")
    name: JobName = Field(description="Job name: 1-63 letters, digits, '.', '_', '-'; names the run and folder.")
    work: WorkSpec = Field(title="Work", description="What runs.")
    data: list[DataInput] = Field(default_factory=list, description="Inputs staged before the run.")
    request: RequestSpec = Field(title="Request", description="Resources and time.")
    output: OutputSpec = Field(title="Output", description="Destination and the files that mark the job complete.")

    @field_validator("data", mode="before")
    @classmethod
    def _data_none(cls, value: Any) -> Any:
        return [] if value is None else value  # "data:" with nothing under it

    @classmethod
    def _rules(cls, data: Mapping[str, Any]) -> list[RuleError]:
        return input_name_problems(data) + overlap_problems(data)
