"""The wheel holds every subpackage of ``e31``.

``pyproject.toml`` maps the repository's top-level folders onto one import name and lists
the packages by hand (setuptools' discovery cannot follow that mapping); a folder with an
``__init__.py`` left off the list is missing from the wheel, and an installed E31 fails at
its first import of it while the editable install used by the other tests works.
"""

from __future__ import annotations

import pathlib
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _declared() -> tuple[dict[str, str], set[str]]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    return config["package-dir"], set(config["packages"])


def _on_disk(package_dir: dict[str, str]) -> set[str]:
    found = set()
    for top, folder in package_dir.items():
        base = ROOT / folder
        for init in base.rglob("__init__.py"):
            if "__pycache__" in init.parts:
                continue
            rel = init.parent.relative_to(base).parts
            found.add(".".join((top, *rel)))
    return found


def test_every_package_folder_is_in_the_wheel_list():
    package_dir, listed = _declared()
    on_disk = _on_disk(package_dir)
    assert sorted(on_disk - listed) == [], "add these to [tool.setuptools] packages"
    assert sorted(listed - on_disk) == [], "these are listed but have no __init__.py"
