"""docker/prepare-a100-data, the image's preparation of the A100 recipe's data (compose's
`prepare` service and the Kubernetes data Job run it), run by /bin/sh with a stand-in `m3run`
first on PATH that records its calls and writes the manifests prepare-data would."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from m3run.runner.config import load_config
from m3run.runner.protocol import EXIT_CONFIG

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "docker" / "prepare-a100-data"
RECIPE = REPO / "configs" / "pretrain_a100_434m.yaml"

# The stand-in: records argv; `prepare-data ... --out DIR` writes DIR/{train,val}/manifest.json,
# unless DIR's name is in STANDIN_FAIL, where it exits 78 as prepare-data does on a bad input.
STANDIN = f"""#!{sys.executable}
import os, sys
from pathlib import Path
with open(os.environ["STANDIN_CALLS"], "a") as f:
    f.write("\\0".join(sys.argv[1:]) + "\\n")
out = Path(sys.argv[sys.argv.index("--out") + 1])
if out.name in os.environ.get("STANDIN_FAIL", "").split():
    sys.exit(78)
for split in ("train", "val"):
    (out / split).mkdir(parents=True, exist_ok=True)
    (out / split / "manifest.json").write_text("{{}}")
"""


@pytest.fixture
def box(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "m3run").write_text(STANDIN)
    (bin_dir / "m3run").chmod(0o755)
    env = {
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "STANDIN_CALLS": str(tmp_path / "calls"),
        "M3RUN_RAW_DIR": str(tmp_path / "data" / "raw"),
        "M3RUN_DATA_DIR": str(tmp_path / "data"),
    }
    return tmp_path, env


def run(env: dict, **extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["/bin/sh", str(SCRIPT)], env={**env, **extra}, capture_output=True, text=True, timeout=60
    )


def calls(d: Path) -> list[list[str]]:
    path = d / "calls"
    return [line.split("\0") for line in path.read_text().splitlines()] if path.exists() else []


def test_it_prepares_every_source_the_recipe_reads(box):
    d, env = box
    r = run(env)
    assert r.returncode == 0, r.stderr
    made = calls(d)
    assert all(argv[0] == "prepare-data" for argv in made)
    outs = {argv[argv.index("--out") + 1] for argv in made}
    # the recipe reads /data/<source>/train (and val): the script writes /data/<source>
    cfg = load_config(RECIPE)
    wanted = {str(Path(s.path).parent) for s in cfg.data.sources}
    assert str(Path(cfg.data.val_path).parent) in wanted
    data = str(d / "data")
    assert {o.replace(data, "/data", 1) for o in outs} == wanted
    # inputs come from the raw root, with the globs left for prepare-data to expand
    raw = str(d / "data" / "raw")
    inputs = [a for argv in made for a in argv[1 : argv.index("--out")]]
    assert inputs and all(a.startswith(raw + "/") for a in inputs)
    assert any("*" in a for a in inputs)


def test_a_retry_skips_the_sources_prepared_already(box):
    d, env = box
    assert run(env, STANDIN_FAIL="openmath").returncode == EXIT_CONFIG
    first = calls(d)
    # the sources after the failing one were not started
    assert first[-1][first[-1].index("--out") + 1].endswith("/openmath")
    r = run(env)
    assert r.returncode == 0, r.stderr
    second = calls(d)[len(first) :]
    redone = [argv[argv.index("--out") + 1].rsplit("/", 1)[1] for argv in second]
    assert redone == ["openmath", "arxiv"]
    assert r.stdout.count("prepared already") == len(first) - 1
    assert run(env).returncode == 0
    assert len(calls(d)) == len(first) + len(second)  # all done: nothing runs again
