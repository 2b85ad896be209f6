"""Print what pyproject.toml's [project] requires, plus the named extras, one requirement a line.

The image installs these in a layer of their own, copied before the code, so that a change to the
code rebuilds only the small layer that installs m3run itself:

    python project_requirements.py pyproject.toml mirror wandb tensorboard > requirements.txt

An extra that pyproject.toml does not define is an error that fails the build, never an empty
install: pip only warns about a missing extra, and the image would ship without it.
"""

from __future__ import annotations

import sys
import tomllib


def requirements(pyproject: str, extras: list[str]) -> list[str]:
    with open(pyproject, "rb") as f:
        project = tomllib.load(f)["project"]
    defined = project.get("optional-dependencies", {})
    missing = [e for e in extras if e not in defined]
    if missing:
        raise SystemExit(
            f"{pyproject} defines no extra {', '.join(missing)} "
            f"(it has: {', '.join(sorted(defined)) or 'none'})"
        )
    out = list(project.get("dependencies", []))
    for extra in extras:
        out += [r for r in defined[extra] if r not in out]
    return out


if __name__ == "__main__":
    if len(sys.argv) < 2:
        raise SystemExit(f"usage: {sys.argv[0]} PYPROJECT [EXTRA ...]")
    print("\n".join(requirements(sys.argv[1], sys.argv[2:])))
