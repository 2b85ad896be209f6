"""Data paths in a frozen config: absolute from the first launch on, so that a run dir names its
data wherever it is used from; a run dir frozen with relative paths keeps its config and hash."""

from __future__ import annotations

from pathlib import Path

import pytest

from m3run.runner.config import (
    ConfigError,
    config_hash,
    load_config,
    load_frozen_config,
    resolve_data_paths,
)
from m3run.runner.files import read_jsonl
from m3run.runner.protocol import CONFIG_FILE, EVENTS_FILE
from m3run.runner.supervisor.launch import LaunchError, LaunchOptions, freeze_config

DEMO = Path(__file__).resolve().parents[3] / "configs" / "demo_cpu.yaml"


def test_a_first_launch_freezes_the_data_paths_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run_dir = tmp_path / "runs" / "r"
    run_dir.mkdir(parents=True)
    opts = LaunchOptions(config=DEMO, run_dir=run_dir, overrides=["data.val_path=../v/./val"])
    cfg, chash = freeze_config(opts)
    assert cfg.data.train_path == str(tmp_path / "runs" / "demo-data" / "train")
    assert cfg.data.val_path == str(tmp_path.parent / "v" / "val")
    frozen = load_frozen_config(run_dir / CONFIG_FILE)
    assert frozen.data == cfg.data and config_hash(frozen) == chash
    # Relaunched from elsewhere with the frozen config, or from here with the recipe: the same.
    monkeypatch.chdir(run_dir)
    assert freeze_config(LaunchOptions(config=run_dir / CONFIG_FILE, run_dir=run_dir))[1] == chash
    monkeypatch.chdir(tmp_path)
    assert freeze_config(opts)[1] == chash
    # The recipe from another working directory names other data: a changed config.
    monkeypatch.chdir(run_dir)
    with pytest.raises(LaunchError, match=r"config changed .*data\.train_path"):
        freeze_config(opts)


def test_a_run_dir_frozen_with_relative_paths_keeps_them_and_its_hash(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run_dir = tmp_path / "old"
    run_dir.mkdir()
    # As m3run froze configs before it resolved paths: the recipe's text as it is.
    old_text = load_config(DEMO).to_yaml()
    assert "train_path: runs/demo-data/train" in old_text
    (run_dir / CONFIG_FILE).write_text(old_text)
    old_hash = config_hash(load_frozen_config(run_dir / CONFIG_FILE))
    for config in (DEMO, run_dir / CONFIG_FILE):
        cfg, chash = freeze_config(LaunchOptions(config=config, run_dir=run_dir))
        assert chash == old_hash and cfg.data.train_path == "runs/demo-data/train"
        assert (run_dir / CONFIG_FILE).read_text() == old_text
    assert not (run_dir / EVENTS_FILE).exists() or not [
        e for e in read_jsonl(run_dir / EVENTS_FILE) if e["event"] == "config_replaced"
    ]
    # Pointing it at other data is still a change.
    moved = LaunchOptions(config=DEMO, run_dir=run_dir, overrides=["data.train_path=other/train"])
    with pytest.raises(LaunchError, match=r"data\.train_path: 'runs/demo-data/train' -> '/"):
        freeze_config(moved)


def test_two_spellings_of_one_source_are_refused_once_resolved(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_config(
        DEMO,
        [
            "data.train_path=null",
            "data.sources=[{path: a/train, weight: 1}, {path: ./a/train, weight: 1}]",
        ],
    )
    with pytest.raises(ConfigError, match=r"two sources name the same folder .*a/train"):
        resolve_data_paths(cfg)
    urls = load_config(DEMO, ["data.val_path=s3://bucket/val"])
    assert resolve_data_paths(urls).data.val_path == "s3://bucket/val"
