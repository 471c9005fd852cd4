"""The placement record's one codec: the flow run's ``placement`` parameter
written and read as a typed record, exactly the keys the worker, the fence
and the next plan read."""

from __future__ import annotations

from types import SimpleNamespace

from e31.tasks.placement_record import PlacementRecord, record_of


def test_a_placement_is_written_with_only_its_set_keys_and_read_back_the_same():
    start = PlacementRecord(node="n1", devices=(0, 3), cpus=8, attempt=0)
    handover = PlacementRecord(node="n2", devices=(), cpus=1, attempt=2, after="1f0e2d3c", unstarted=1)
    waiting = PlacementRecord(attempt=1, planned="gpu-1.rack.a")
    assert start.parameter() == {"e31_node": "n1", "gpu_devices": [0, 3], "cpus": 8, "e31_attempt": 0}
    assert handover.parameter() == {"e31_node": "n2", "gpu_devices": [], "cpus": 1, "e31_attempt": 2,
                                    "e31_after": "1f0e2d3c", "e31_unstarted": 1}
    assert waiting.parameter() == {"e31_attempt": 1, "e31_planned": "gpu-1.rack.a"}
    assert PlacementRecord().parameter() == {}
    for record in (start, handover, waiting, PlacementRecord()):
        assert PlacementRecord.from_parameter(record.parameter()) == record


def test_a_placement_parameter_of_the_wrong_shape_reads_as_not_set():
    assert PlacementRecord.from_parameter(None) == PlacementRecord()
    assert PlacementRecord.from_parameter(["n1"]) == PlacementRecord()
    odd = {"e31_node": 3, "gpu_devices": "0,1", "cpus": True, "e31_attempt": "2", "e31_planned": ""}
    assert PlacementRecord.from_parameter(odd) == PlacementRecord()
    assert PlacementRecord.from_parameter({"gpu_devices": [0, "1", 2]}).devices == (0, 2)


def test_a_run_placed_through_its_job_variables_is_read_from_them():
    """A run placed by an E31 before the parameter existed (its node in
    ``job_variables``), as e31.tasks.supervisor.fence.placement_of reads it."""
    old = SimpleNamespace(parameters={"placement": {"e31_attempt": 1}},
                          job_variables={"e31_node": "n4", "gpu_devices": [1], "cpus": 2})
    assert record_of(old) == PlacementRecord(node="n4", devices=(1,), cpus=2)
    new = SimpleNamespace(parameters={"placement": {"e31_node": "n1", "gpu_devices": [], "cpus": 1}},
                          job_variables={"e31_node": "n4"})
    assert record_of(new).node == "n1"
    assert record_of(SimpleNamespace()) == PlacementRecord()
