"""Experiment trackers: the choice (log.tracker, M3RUN_TRACKER, WANDB_PROJECT), one clear error
at launch when the chosen one cannot start, TensorBoard files beside metrics.jsonl, and a wandb
run keyed on the run dir."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess

import pytest
from helpers.launching import launch_argv
from helpers.runs import REPO, tiny_run_overrides, worker_env
from helpers.training import run_worker

from m3run.runner.files import read_jsonl
from m3run.runner.protocol import EXIT_CONFIG, METRICS_FILE
from m3run.runner.tracking import resolve_tracker, tracker_problem


def test_the_environment_overrides_the_configured_tracker():
    assert resolve_tracker("none", {}) == "none"
    assert resolve_tracker("none", {"WANDB_PROJECT": "x"}) == "wandb"
    assert resolve_tracker("wandb", {"M3RUN_TRACKER": "tensorboard"}) == "tensorboard"
    assert "not a tracker" in tracker_problem("none", {"M3RUN_TRACKER": "mlflow"})
    no_login = tracker_problem("none", {"WANDB_PROJECT": "x", "HOME": "/nonexistent"})
    if importlib.util.find_spec("wandb") is not None:
        assert "wandb login" in no_login


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("wandb") is not None,
    reason="wandb is installed here: this checks the launch without it",
)
def test_wandb_project_without_wandb_is_one_clear_error_at_launch(corpus, tmp_path):
    run_dir = tmp_path / "run"
    done = subprocess.run(
        launch_argv(run_dir, tiny_run_overrides(corpus)),
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
        env=worker_env(WANDB_PROJECT="x"),
    )
    assert done.returncode == EXIT_CONFIG, done.stdout + done.stderr
    assert "WANDB_PROJECT=x is set but wandb is not installed" in done.stderr
    assert "pip install 'm3run[wandb]'" in done.stderr and "Traceback" not in done.stderr
    assert not (run_dir / "worker.log").exists(), "the worker started anyway"


@pytest.mark.slow
def test_tensorboard_writes_the_logged_metrics_beside_metrics_jsonl(corpus, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = tmp_path / "run"
    sets = tiny_run_overrides(
        corpus, **{"train.total_steps": 6, "eval.interval_steps": 3, "log.tracker": "tensorboard"}
    )
    done = run_worker(run_dir, sets)
    assert done.returncode == 0, done.stderr
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "train/lr", "eval/loss", "system/tokens_per_s"} <= tags, tags
    assert all(t.split("/")[0] in ("train", "eval", "system") for t in tags), tags
    records = read_jsonl(run_dir / METRICS_FILE)
    for tag, kind, key in (("train/loss", "train", "loss"), ("eval/loss", "eval", "eval_loss")):
        logged = {e.step: e.value for e in events.Scalars(tag)}
        expect = {r["step"]: r[key] for r in records if r["kind"] == kind}
        assert logged.keys() == expect.keys(), tag
        assert all(logged[s] == pytest.approx(expect[s], rel=1e-6) for s in expect)


@pytest.mark.slow
def test_tensorboard_records_the_frozen_config_as_hyperparameters_once_per_run(corpus, tmp_path):
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData

    run_dir = tmp_path / "run"
    sets = tiny_run_overrides(corpus, **{"train.total_steps": 4, "log.tracker": "tensorboard"})
    assert run_worker(run_dir, sets).returncode == 0
    # Resumed and extended: a second event file, the same run.
    longer = [*sets, "train.total_steps=6"]
    done = run_worker(run_dir, longer, "--force")
    assert done.returncode == 0, done.stderr
    files = sorted((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert len(files) == 2
    starts = []
    for path in files:
        for event in EventFileLoader(str(path)).Load():
            for value in event.summary.value:
                if value.tag == "_hparams_/session_start_info":
                    data = HParamsPluginData.FromString(value.metadata.plugin_data.content)
                    starts.append((path, data.session_start_info.hparams))
    assert [path for path, _ in starts] == [files[0]]
    hparams = starts[0][1]
    assert hparams["model.d_model"].number_value == 64
    assert hparams["train.total_steps"].number_value == 4
    assert hparams["data.train_path"].string_value == str(corpus / "train")


@pytest.mark.slow
def test_a_wandb_run_is_keyed_on_the_run_dir_not_the_config(corpus, tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "wandb.py").write_text(
        "import json, os\n"
        "class Run:\n"
        "    def log(self, *a, **k): pass\n"
        "    def finish(self): pass\n"
        "def init(**kw):\n"
        "    with open(os.environ['IDS'], 'a') as f:\n"
        "        f.write(json.dumps(kw['id']) + '\\n')\n"
        "    return Run()\n"
    )
    ids = tmp_path / "ids.jsonl"
    env = worker_env(
        WANDB_PROJECT="m3",
        IDS=str(ids),
        PYTHONPATH=os.pathsep.join([str(site), str(REPO)]),
    )
    sets = tiny_run_overrides(corpus, **{"train.total_steps": 2})
    for name in ("a", "b"):
        assert run_worker(tmp_path / name, sets, env=env).returncode == 0
    relaunch = [*sets, "train.total_steps=3"]
    assert run_worker(tmp_path / "a", relaunch, "--force", env=env).returncode == 0
    a, b, a_again = (json.loads(line) for line in ids.read_text().splitlines())
    assert a != b, "two run dirs with one config share a wandb run"
    assert a == a_again, "a relaunch of the same run dir starts a new wandb run"
