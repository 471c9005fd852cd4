"""The rendezvous of a gang's attempt, written on its flow run by the lead and read by each member.

The flow run's label :data:`LABEL` holds one JSON object (Prefect's labels are merged key by key on the
server, so the write never overwrites a tag or another label written meanwhile)::

    {"attempt": 2, "token": "5f1c0a9e3b7d", "addr": "10.231.0.2", "port": 29500, "resume": 40,
     "stop_at": 1796543210.5, "grace_s": 30}

``attempt``: the flow run's ``run_count`` when the lead wrote it (a member of another attempt waits for its
own); ``token``: this try of the lead's work (a failed work tried again within the attempt publishes a
new one, and each member's worker starts a member for it); ``addr``/``port``: where rank 0's store listens; ``resume``: the checkpoint step the lead resumes from
(null: a fresh start); ``stop_at``: when the lead's work is killed at the latest (Unix seconds), ``grace_s``
before which it is warned.  When the lead's work is warned to stop (its time limit, deadline, a cancel, a
preemption, a signal), the lead writes :data:`STOP_LABEL`: ``{"token": "5f1c0a9e3b7d", "reason":
"time_limit"}``, and each member warns its own work.  Each member writes :data:`MEMBER_LABEL` + its rank
when its work ends: ``{"attempt": 2, "token": "5f1c0a9e3b7d", "exit": 0}``.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["LABEL", "MEMBER_LABEL", "STOP_LABEL", "Published", "member_ends", "member_token", "publish",
           "publish_stop", "published", "report_member", "stop_of"]

LABEL = "e31.rendezvous"
MEMBER_LABEL = "e31.member."
STOP_LABEL = "e31.stop"


@dataclass(frozen=True)
class Published:
    """One attempt's rendezvous as the lead published it (see the module docstring for each field)."""

    attempt: int
    token: str
    addr: str
    port: int
    resume: int | None
    stop_at: float
    grace_s: float


def publish(client: Any, run_id: str, value: Published) -> None:
    """Write ``value`` on the flow run ``run_id`` (a sync Prefect client).  Raises what the client raises."""
    client.update_flow_run_labels(run_id, {LABEL: json.dumps(asdict(value), sort_keys=True)})


def published(run: Any) -> Published | None:
    """The rendezvous on the flow run ``run`` (a Prefect ``FlowRun``), or None when none was written or it
    is not one E31 wrote."""
    text = (getattr(run, "labels", None) or {}).get(LABEL)
    try:
        value = json.loads(text) if isinstance(text, str) else None
        return Published(int(value["attempt"]), str(value["token"]), str(value["addr"]), int(value["port"]),
                         None if value.get("resume") is None else int(value["resume"]), float(value["stop_at"]),
                         float(value["grace_s"]))
    except (TypeError, ValueError, KeyError):
        return None


def report_member(client: Any, run_id: str, rank: int, pub: Published, exit_code: int) -> None:
    """Write a member's end (its work's exit status) of the try ``pub`` on the flow run.  Raises what the
    client raises."""
    client.update_flow_run_labels(run_id, {f"{MEMBER_LABEL}{rank}": json.dumps(
        {"attempt": pub.attempt, "token": pub.token, "exit": exit_code})})


def member_token(run: Any, rank: int) -> str | None:
    """The try (its token) whose end member ``rank`` last wrote on ``run``, or None."""
    try:
        return str(json.loads((getattr(run, "labels", None) or {}).get(f"{MEMBER_LABEL}{rank}"))["token"])
    except (TypeError, ValueError, KeyError):
        return None


def member_ends(run: Any, attempt: int) -> dict[int, int]:
    """Rank -> exit status of each member whose work of ``attempt`` has ended, as written on ``run``."""
    ends = {}
    for key, text in (getattr(run, "labels", None) or {}).items():
        if not key.startswith(MEMBER_LABEL):
            continue
        try:
            value = json.loads(text)
            if int(value["attempt"]) == attempt:
                ends[int(key[len(MEMBER_LABEL):])] = int(value["exit"])
        except (TypeError, ValueError, KeyError):
            continue
    return ends


def publish_stop(client: Any, run_id: str, token: str, reason: str) -> None:
    """Write that the lead's work of the try ``token`` was warned to stop, and why.  Raises what the client
    raises."""
    client.update_flow_run_labels(run_id, {STOP_LABEL: json.dumps({"token": token, "reason": reason})})


def stop_of(run: Any, token: str) -> str | None:
    """Why the lead's work of the try ``token`` was warned to stop, as written on ``run``; None when it was
    not."""
    try:
        value = json.loads((getattr(run, "labels", None) or {}).get(STOP_LABEL))
        return str(value["reason"]) if str(value["token"]) == token else None
    except (TypeError, ValueError, KeyError):
        return None
