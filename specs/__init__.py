"""E31 job specs: the contract a job declares (work, data, request, output).

Imports only the standard library, pydantic and yaml, so a spec can be
validated anywhere. See docs/design.md, section 1.
"""

from .errors import Problem, SpecError
from .loader import load_spec, parse_spec
from .models import CheckpointPolicy, DataInput, JobSpec, OutputSpec, RequestSpec, WorkSpec
from .payload import secrets_in, spec_payload
from .pool import NodeSpec, PoolSpec, load_pool, pool_json_schema
from .schema import json_schema
from .storage_options import is_credential_key, reference_of
from .units import parse_duration, parse_memory
from .urls import mask_url

__all__ = [
    "CheckpointPolicy",
    "DataInput",
    "JobSpec",
    "NodeSpec",
    "OutputSpec",
    "PoolSpec",
    "Problem",
    "RequestSpec",
    "SpecError",
    "WorkSpec",
    "is_credential_key",
    "json_schema",
    "load_pool",
    "load_spec",
    "mask_url",
    "parse_duration",
    "parse_memory",
    "parse_spec",
    "pool_json_schema",
    "reference_of",
    "secrets_in",
    "spec_payload",
]
