"""E31 is one import name, ``e31``: it lives beside a user's own ``flows``,
``tasks`` and ``specs`` modules, in the work's folder as in the caller's."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap


def test_only_e31_is_installed_at_the_top_level(tmp_path):
    code = ("import importlib.util as u, json; "
            "print(json.dumps({n: u.find_spec(n) is not None for n in "
            "['e31', 'flows', 'tasks', 'specs', 'deployments', 'examples']}))")
    found = json.loads(subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                                      check=True).stdout)
    assert found == {"e31": True, "flows": False, "tasks": False, "specs": False, "deployments": False,
                     "examples": False}


def test_importing_the_spec_layer_imports_no_prefect_fsspec_or_torch(tmp_path):
    code = ("import sys, e31, e31.specs; "
            "print(sorted(m for m in ('prefect', 'fsspec', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_a_spec_folder_with_its_own_tasks_flows_and_specs_modules_runs(e31, tmp_path, prefect_api, scratch):
    """The work's folder goes first on its ``sys.path``: its own ``tasks.py``,
    ``flows.py`` and ``specs.py`` are what the work imports, and E31's child
    still finds ``e31.tasks``."""
    folder = tmp_path / "project"
    folder.mkdir()
    (folder / "tasks.py").write_text("settings = {'who': 'the user tasks module'}\n")
    (folder / "flows.py").write_text("NAME = 'the user flows module'\n")
    (folder / "specs.py").write_text("KIND = 'the user specs module'\n")
    (folder / "mywork.py").write_text(textwrap.dedent("""
        import json
        import flows, specs, tasks

        def run(ctx):
            (ctx.output_dir / "seen.json").write_text(json.dumps(
                [tasks.settings["who"], flows.NAME, specs.KIND, ctx.params["x"]]))
    """))
    (folder / "job.yaml").write_text(textwrap.dedent(f"""
        name: own-modules
        work: {{kind: processing, entrypoint: "mywork:run", params: {{x: 7}}}}
        request: {{cpus: 1, limit: 2m}}
        output: {{kind: results, url: {tmp_path / 'out'}, files: [seen.json]}}
    """))
    result = e31("run", str(folder / "job.yaml"), env={"E31_SCRATCH": str(scratch)})
    assert result.returncode == 0, result.stderr
    assert json.loads((tmp_path / "out" / "seen.json").read_text()) == [
        "the user tasks module", "the user flows module", "the user specs module", 7]
