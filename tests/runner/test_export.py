"""A trained run's model out of its run dir: `m3run generate`, `m3run export` and loading the
export back with one call; `m3run list` and `checkpoints` on the same run."""

from __future__ import annotations

import json

import pytest
import torch
from helpers.runs import tiny_run_overrides
from helpers.training import run_worker
from typer.testing import CliRunner

from m3run.model import Mamba3LM
from m3run.runner.cli import app
from m3run.runner.data.tokenizer import load_tokenizer

pytestmark = pytest.mark.slow


def invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args], catch_exceptions=False)


@pytest.fixture(scope="module")
def trained(corpus, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("runs") / "tiny"
    done = run_worker(run_dir, tiny_run_overrides(corpus, **{"train.total_steps": 10}))
    assert done.returncode == 0, done.stderr
    return run_dir


def test_an_export_loads_back_and_generates_what_the_checkpoint_generates(
    trained, corpus, tmp_path
):
    out = tmp_path / "export"
    result = invoke("export", trained, out)
    assert result.exit_code == 0, result.output
    assert {p.name for p in out.iterdir()} >= {"model.safetensors", "config.json", "tokenizer.json"}
    config = json.loads((out / "config.json").read_text())
    assert config["step"] == "10" and config["tokenizer"]["kind"] == "hf"

    model = Mamba3LM.from_export(out)  # the one call
    tok = load_tokenizer(corpus / "train")
    prompt = tok.encode("def main(")
    torch.manual_seed(3)
    ids = model.generate(torch.tensor([prompt]), 12, temperature=0.8, top_k=20)[0, len(prompt) :]
    said = invoke(
        "generate",
        trained,
        "--prompt",
        "def main(",
        "--max-new-tokens",
        12,
        "--temperature",
        0.8,
        "--top-k",
        20,
        "--seed",
        3,
    )
    assert said.exit_code == 0, said.output
    assert said.output.rstrip("\n") == "def main(" + tok.decode(ids.tolist())


def test_generate_and_export_name_a_missing_checkpoint(trained, tmp_path):
    result = invoke("generate", trained, "--prompt", "x", "--step", 7)
    assert result.exit_code == 1 and "no checkpoint for step 7" in result.output
    empty = tmp_path / "not-an-export"
    empty.mkdir()
    (empty / "notes.txt").write_text("mine")
    result = invoke("export", trained, empty)
    assert result.exit_code == 1 and "not an m3run export" in result.output


def test_export_refuses_a_folder_of_someone_elses_model_files(trained, tmp_path):
    hf = tmp_path / "hf-model"
    hf.mkdir()
    files = {
        "config.json": '{"model_type": "gpt2"}',
        "model.safetensors": "weights",
        "tokenizer.json": "{}",
    }
    for name, text in files.items():
        (hf / name).write_text(text)
    result = invoke("export", trained, hf)
    assert result.exit_code == 1, result.output
    (line,) = result.output.strip().splitlines()
    assert str(hf) in line and "not an m3run export" in line
    assert "config.json" in line and "new or empty directory" in line
    assert {p.name: p.read_text() for p in hf.iterdir()} == files


def test_export_into_a_file_or_a_symlink_is_a_one_line_error(trained, tmp_path):
    file = tmp_path / "a-file"
    file.write_text("mine")
    target = tmp_path / "elsewhere"
    target.mkdir()
    link = tmp_path / "a-link"
    link.symlink_to(target)
    for out, what in ((file, "is a file"), (link, "is a symlink")):
        result = CliRunner().invoke(app, ["export", str(trained), str(out)])
        assert result.exit_code == 1, result.output
        assert result.exception is None or isinstance(result.exception, SystemExit)
        (line,) = result.output.strip().splitlines()
        assert str(out) in line and what in line and "Traceback" not in result.output
    assert file.read_text() == "mine" and not any(target.iterdir())


def test_export_twice_into_the_same_directory_replaces_the_first(trained, tmp_path):
    out = tmp_path / "export"
    first = invoke("export", trained, out)
    assert first.exit_code == 0 and "exported to" in first.output, first.output
    marker = json.loads((out / "m3run-export.json").read_text())
    assert marker["step"] == 10 and marker["run"] == str(trained.resolve())
    again = invoke("export", trained, out)
    assert again.exit_code == 0 and "replaced the earlier export" in again.output, again.output
    assert Mamba3LM.from_export(out).config.vocab_size > 0


def test_list_shows_runs_under_the_runs_root_from_the_environment(trained, monkeypatch):
    monkeypatch.setenv("M3RUN_RUNS", str(trained.parent))
    result = invoke("list")
    assert result.exit_code == 0, result.output
    assert "tiny" in result.output and "10/10" in result.output
    rows = json.loads(invoke("list", "--json").output)
    assert [r["step"] for r in rows] == [10]


def test_checkpoints_list_without_hashing_unless_asked(trained):
    fast = invoke("checkpoints", trained)
    assert fast.exit_code == 0 and "--verify" in fast.output
    full = invoke("checkpoints", trained, "--verify")
    assert full.exit_code == 0 and "complete" in full.output


def test_detach_has_a_short_form():
    assert "-d, --detach" in invoke("launch", "--help").output
