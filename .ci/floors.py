"""Constraints that pin every floor pyproject.toml declares (``name>=X`` becomes ``name==X``), for ``make floors``.

``python .ci/floors.py [EXTRA ...] > constraints.txt``: ``[project].dependencies`` and the named optional extras.
Runs on Python 3.11 or newer (``tomllib``).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import tomllib

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"
# PEP 508 as pyproject.toml writes it: name, optional [extras], comma-separated specifiers, optional "; marker"
REQUIREMENT = re.compile(
    r"^(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*)\s*(\[[^\]]*\])?\s*(?P<specs>[^;]*?)\s*(;(?P<marker>.*))?$"
)
LOWER_BOUNDS = (">=", "~=", "==")  # `~=X` and `==X` admit X as their lowest version too


def floor_pin(requirement: str) -> str:
    """``jsonargparse[signatures]>=4.39,<5`` -> ``jsonargparse==4.39``; an environment marker is kept."""
    match = REQUIREMENT.match(requirement.strip())
    if match is None:
        raise ValueError(f"{PYPROJECT}: cannot read the requirement {requirement!r}")
    specs = [s.strip() for s in match["specs"].split(",") if s.strip()]
    floors = [s[2:].strip() for s in specs if s.startswith(LOWER_BOUNDS)]
    if len(floors) != 1:
        raise ValueError(
            f"{PYPROJECT}: {requirement!r} needs one lower bound (name>=X): X is the version `make floors` tests"
        )
    marker = f" ; {match['marker'].strip()}" if match["marker"] else ""
    return f"{match['name']}=={floors[0]}{marker}"


def floor_constraints(extras: list[str]) -> list[str]:
    """One ``name==X`` line per requirement of the project and of ``extras``."""
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    optional = project.get("optional-dependencies", {})
    for extra in extras:
        if extra not in optional:
            raise ValueError(f"{PYPROJECT} has no extra {extra!r}; it has {', '.join(sorted(optional))}")
    return [floor_pin(r) for r in [*project["dependencies"], *(r for e in extras for r in optional[e])]]


if __name__ == "__main__":
    try:
        lines = floor_constraints(sys.argv[1:])
    except ValueError as err:
        sys.exit(f"floors.py: {err}")
    print(f"# every floor of pyproject.toml ([project].dependencies {' '.join(sys.argv[1:])}) pinned, by .ci/floors.py")
    print("\n".join(lines))
