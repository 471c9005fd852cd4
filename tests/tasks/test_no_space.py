"""What a failed run says of disk space: this node's scratch disk is blamed only when it is (nearly) full;
"No space left on device" in the work's error output with room here points at another disk (on a job of
several nodes, often another rank's node)."""

from __future__ import annotations

from e31.tasks.storage.local import human_size, mount_point, no_space, space


def test_a_full_disk_said_by_the_work_is_not_blamed_on_a_scratch_with_room(tmp_path):
    free, _ = space(tmp_path)
    assert free > 10 * 2**30, "this test needs a scratch disk with room"
    line = no_space(tmp_path, said=True)
    assert line.startswith(f"the work's error output says No space left on device, and {mount_point(tmp_path)} "
                           f"(holding {tmp_path}) has ")
    assert line.endswith(" free: the full disk is another one it wrote to (on a job of several nodes, maybe "
                         "another rank's node: see its lines in the flow run's log)")
    assert human_size(free)[-3:] in line  # the unit of what is free here
    assert no_space(tmp_path, said=False) is None
