"""Write tests/deploy/schemas/skypilot.json: SkyPilot's own task, resources and storage schemas.

The skypilot package (hundreds of MB, a server stack, pins that clash with this project's) is too
heavy for the dev extra, so its schemas are taken out once and checked in; the test validates the
task with them the way SkyPilot does (Draft 7 plus its case-insensitive enum keyword). Run it in
a throwaway venv whenever SkyPilot is upgraded:

    python -m venv /tmp/sky && /tmp/sky/bin/pip install 'skypilot==0.14.1'
    /tmp/sky/bin/python tests/deploy/make_skypilot_schema.py

It also loads deploy/skypilot/pretrain-spot.yaml with SkyPilot itself (`sky.Task.from_yaml`),
which runs the checks that live in code rather than in the schema.
"""

from __future__ import annotations

import json
from pathlib import Path

import sky
from sky.utils import schemas

HERE = Path(__file__).resolve().parent
OUT = HERE / "schemas" / "skypilot.json"
TASK = HERE.parents[1] / "deploy" / "skypilot" / "pretrain-spot.yaml"


def main() -> None:
    doc = {
        "source": "sky/utils/schemas.py of the skypilot package (github.com/skypilot-org/skypilot)",
        "license": "Apache-2.0",
        "skypilot_version": sky.__version__,
        "generated_by": "tests/deploy/make_skypilot_schema.py",
        "task": schemas.get_task_schema(),
        "resources": schemas.get_resources_schema(),
        "storage": schemas.get_storage_schema(),
    }
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    print(f"wrote {OUT} (skypilot {sky.__version__})")
    task = sky.Task.from_yaml(str(TASK))
    print(f"SkyPilot loads {TASK.name}: {task}")


if __name__ == "__main__":
    main()
