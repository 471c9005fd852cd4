"""Specs nested too deeply, and names with characters that hide what they
are, are refused with one line naming the field and exit code 2 from the
real ``e31 validate`` (no RecursionError, no serialisation error)."""

from __future__ import annotations

import json

import pytest

from e31.specs import JobSpec, SpecError, parse_spec
from e31.specs.nesting import MAX_NESTING

DEEP = ("nested too deeply: a spec may nest mappings and lists at most 64 levels deep, counted from the top of the "
        "document (got more than 64 levels); flatten it, or put deeply nested data in an input file (data:) and read "
        "it in the work")
HIDDEN = ("must not hold control characters or bidirectional-text controls: a name holding them shows differently "
          "from what it is (got {got}); remove it and write the name with visible characters only")


def _spec(tmp_path) -> dict:
    return {"name": "j", "work": {"kind": "processing", "command": ["echo", "x"]}, "request": {"limit": "1m"},
            "output": {"kind": "results", "url": str(tmp_path / "out") + "/", "files": ["x.txt"]}}


def _nest(levels: int) -> dict:
    value: dict | int = 1
    for _ in range(levels):
        value = {"a": value}
    return value


def _refusal(e31, path, problems: list[str]):
    result = e31("validate", str(path))
    assert (result.returncode, result.stdout) == (2, "")
    noun = "problem" if len(problems) == 1 else "problems"
    assert result.stderr == f"invalid job spec {path} ({len(problems)} {noun})\n" + "".join(
        f"  {p}\n" for p in problems)


def test_a_json_spec_nested_500_deep_is_refused_naming_the_field(e31, tmp_path):
    spec = _spec(tmp_path) | {"extra": _nest(500)}
    path = tmp_path / "deep.json"
    path.write_text(json.dumps(spec))
    _refusal(e31, path, [f"extra: {DEEP}"])


def test_the_same_depth_in_yaml_is_refused_with_the_same_line(e31, tmp_path):
    path = tmp_path / "deep.yaml"
    path.write_text(json.dumps(_spec(tmp_path) | {"extra": _nest(500)}))  # JSON is YAML (flow style)
    _refusal(e31, path, [f"extra: {DEEP}"])
    block = tmp_path / "block.yaml"  # block style, indented 400 levels
    block.write_text("name: j\nwork:\n  kind: processing\n  command: [echo]\n  params:\n"
                     + "".join("  " * (level + 2) + "a:\n" for level in range(400)) + "  " * 402 + "b: 1\n"
                     + f"request: {{limit: 1m}}\noutput: {{kind: results, url: {tmp_path}/o/, files: [x]}}\n")
    _refusal(e31, block, [f"work.params: {DEEP}"])


@pytest.mark.parametrize("levels", [300, 400])
def test_work_params_nested_300_to_400_deep_is_refused_naming_it(e31, tmp_path, levels):
    spec = _spec(tmp_path)
    spec["work"]["params"] = {"p": _nest(levels)}
    path = tmp_path / "params.json"
    path.write_text(json.dumps(spec))
    _refusal(e31, path, [f"work.params: {DEEP}"])


def test_the_limit_is_exact_and_the_same_from_python(tmp_path):
    spec = _spec(tmp_path)
    spec["work"]["params"] = {"p": _nest(MAX_NESTING - 3)}  # document, work, params, p's value: 64 levels
    assert JobSpec.model_validate(spec).work.params["p"] == _nest(MAX_NESTING - 3)
    spec["data"] = [{"name": "d", "url": "/srv/in/", "storage_options": {"x": _nest(MAX_NESTING - 3)}}]
    with pytest.raises(SpecError) as info:
        JobSpec.model_validate(spec)
    assert str(info.value) == f"invalid job spec <spec> (1 problem)\n  data[0].storage_options: {DEEP}"
    with pytest.raises(SpecError) as again:
        parse_spec(spec)
    assert str(again.value) == str(info.value)
    looped: dict = {}
    looped["self"] = looped  # a mapping that holds itself is refused, not walked forever
    spec = _spec(tmp_path)
    spec["work"]["params"] = looped
    with pytest.raises(SpecError) as info:
        JobSpec.model_validate(spec)
    assert str(info.value) == f"invalid job spec <spec> (1 problem)\n  work.params: {DEEP}"


def test_control_and_right_to_left_characters_in_names_and_urls_are_refused(e31, tmp_path):
    spec = _spec(tmp_path)
    spec["output"]["url"] = "/srv/results/\u202eexe.txt/"
    spec["output"]["files"] = ["report\u202efdp.exe", "a\nb.txt", "ok.txt"]
    spec["data"] = [{"name": "d", "url": "file:///srv/in/a%0Ab.csv"}, {"name": "e", "url": "/srv/in/\x1b]8;;x"}]
    path = tmp_path / "hidden.json"
    path.write_text(json.dumps(spec))
    _refusal(e31, path, [
        "data[0].url: " + HIDDEN.format(got="U+000A (a control character) at character 10 of its decoded path"),
        "data[1].url: " + HIDDEN.format(got="U+001B (a control character) at character 9"),
        "output.url: " + HIDDEN.format(got="U+202E (RIGHT-TO-LEFT OVERRIDE) at character 14"),
        "output.files[0]: " + HIDDEN.format(got="U+202E (RIGHT-TO-LEFT OVERRIDE) at character 7"),
        "output.files[1]: " + HIDDEN.format(got="U+000A (a control character) at character 2"),
    ])


def test_visible_unicode_names_are_kept(tmp_path):
    spec = _spec(tmp_path)
    spec["output"]["files"] = ["résumé.txt", "数据/结果.json", "emoji-\U0001f600.txt"]
    spec["data"] = [{"name": "d", "url": "file:///srv/in/caf%C3%A9.csv"}]
    assert parse_spec(spec).output.files == ["résumé.txt", "数据/结果.json", "emoji-\U0001f600.txt"]
