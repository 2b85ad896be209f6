"""A trained run's model out of its run dir: `m3run generate`, `m3run export` and loading the
export back with one call; `m3run list` and `checkpoints` on the same run."""

from __future__ import annotations

import importlib.util
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers.launching import launch_argv
from helpers.runs import REPO, tiny_run_overrides, worker_env
from helpers.training import run_worker
from typer.testing import CliRunner

from m3run.model import Mamba3LM
from m3run.runner.cli import app
from m3run.runner.config import load_frozen_config
from m3run.runner.data.tokenizer import load_tokenizer
from m3run.runner.export import TextStream

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
    assert config["step"] == 10 and config["tokenizer"]["kind"] == "hf"

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
    assert full.exit_code == 0 and "verified" in full.output


def test_detach_has_a_short_form():
    assert "-d, --detach" in invoke("launch", "--help").output


# --------------------------------------------------------------------------- the run dir carries


def _m3run(*args, cwd: Path, **kw) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "m3run.runner.cli", *map(str, args)]
    return subprocess.run(
        argv, cwd=cwd, env=worker_env(), capture_output=True, text=True, timeout=240, **kw
    )


@pytest.fixture(scope="module")
def launched(corpus, tmp_path_factory):
    """A run launched with relative data paths from the folder holding its data, which is then
    moved away: the run dir alone must serve generate and export."""
    home = tmp_path_factory.mktemp("home")
    shutil.copytree(corpus, home / "data")
    sets = tiny_run_overrides(
        Path("data"), **{"train.total_steps": 10, "supervisor.smoke": "false"}
    )
    done = _m3run(*launch_argv(Path("runs/tiny"), sets)[3:], cwd=home)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    run_dir = home / "runs" / "tiny"
    (home / "data").rename(home / "data-moved")
    return run_dir


def test_a_launch_keeps_the_tokenizer_and_absolute_data_paths_in_the_run_dir(launched, corpus):
    assert (launched / "tokenizer.json").read_bytes() == (corpus / "tokenizer.json").read_bytes()
    frozen = load_frozen_config(launched / "config.yaml")
    home = launched.parent.parent
    assert frozen.data.train_path == str(home / "data" / "train")
    assert frozen.data.val_path == str(home / "data" / "val")


def test_generate_and_export_work_from_anywhere_with_the_data_gone(launched, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    said = _m3run(
        "generate",
        launched,
        "--prompt",
        "def ",
        "--temperature",
        0,
        "--max-new-tokens",
        8,
        cwd=elsewhere,
    )
    assert said.returncode == 0 and said.stdout.startswith("def "), said.stderr
    out = tmp_path / "export"
    done = _m3run("export", launched, out, cwd=elsewhere)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    assert (out / "tokenizer.json").read_bytes() == (launched / "tokenizer.json").read_bytes()


def test_a_run_dir_without_its_tokenizer_or_data_is_a_one_line_error(
    trained, tmp_path, monkeypatch
):
    # A run dir as m3run made them before it kept the tokenizer: relative data paths, no
    # tokenizer.json; used from a directory where those paths lead nowhere.
    old = tmp_path / "old-run"
    shutil.copytree(trained, old)
    assert not (old / "tokenizer.json").exists()
    text = (old / "config.yaml").read_text()
    train = load_frozen_config(old / "config.yaml").data.train_path
    (old / "config.yaml").write_text(text.replace(str(Path(train).parent), "data"))
    monkeypatch.chdir(tmp_path)
    for args in (["generate", old, "--prompt", "x"], ["export", old, tmp_path / "out"]):
        result = CliRunner().invoke(app, [str(a) for a in args])
        assert result.exit_code == 1, result.output
        assert result.exception is None or isinstance(result.exception, SystemExit)
        (line,) = result.output.strip().splitlines()
        assert "no tokenizer.json" in line and "data/train" in line and "relaunch" in line
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------- generate's arguments


def test_generate_checks_its_arguments_before_it_imports_torch(trained):
    code = (
        "import json, sys\n"
        "from typer.testing import CliRunner\n"
        "from m3run.runner.cli import app\n"
        f"run = {str(trained)!r}\n"
        "cases = [[], ['--prompt', ''], ['--prompt', 'x', '--max-new-tokens', '100000000'],\n"
        "         ['--prompt', 'x', '--step', '7'], ['--prompt', 'x', '--top-p', '0']]\n"
        "said = []\n"
        "for extra in cases:\n"
        "    r = CliRunner().invoke(app, ['generate', run, *extra], catch_exceptions=False)\n"
        "    said.append([r.exit_code, r.output])\n"
        "said.append(sorted(m for m in sys.modules if m.split('.')[0] == 'torch')[:3])\n"
        "print(json.dumps(said))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=worker_env(), timeout=60
    )
    assert done.returncode == 0, done.stderr
    *said, torch_modules = json.loads(done.stdout)
    assert torch_modules == []
    codes = [code for code, _ in said]
    assert codes == [2, 2, 2, 1, 2], said
    missing, empty, too_many, no_step, top_p = (text for _, text in said)
    assert "Missing option '--prompt'" in missing
    assert "--prompt is empty" in empty
    assert "--max-new-tokens 100000000" in too_many and "64 tokens" in too_many
    assert "--beyond-context" in too_many
    assert "no checkpoint for step 7" in no_step
    assert "--top-p must be > 0" in top_p


def test_the_help_texts_say_what_the_commands_do():
    shown = invoke("generate", "--help").output
    assert "--prompt TEXT" in shown and "[required]" in shown.split("--step")[0]
    assert "--beyond-context" in shown
    shown = invoke("export", "--help").output
    assert "RUN" in shown and "latest run" not in shown and "trust_remote_code" in shown


def test_generate_streams_its_text_and_stops_on_ctrl_c(trained):
    argv = [sys.executable, "-m", "m3run.runner.cli", "generate", str(trained)]
    argv += ["--prompt", "def ", "--temperature", "0", "--max-new-tokens", "1000000"]
    proc = subprocess.Popen(
        [*argv, "--beyond-context"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=worker_env(),
    )
    try:
        seen = b""
        # A million greedy tokens take far longer than this: text before the end is streamed.
        deadline = time.monotonic() + 120
        while len(seen) < len("def ") + 20 and time.monotonic() < deadline:
            ready, _, _ = select.select([proc.stdout], [], [], 5)
            if ready:
                chunk = os.read(proc.stdout.fileno(), 4096)
                if not chunk:
                    break
                seen += chunk
        assert seen.startswith(b"def ") and len(seen) >= len("def ") + 20, seen
        assert proc.poll() is None, "generate ended before it was stopped"
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 0 and b"Traceback" not in err, err.decode()


def test_streamed_text_holds_back_a_character_split_across_tokens(corpus):
    tok = load_tokenizer(corpus / "train")
    text = "naïve café: 中文字 🙂 done"
    ids = tok.encode(text)
    assert len(ids) > len(text) / 2  # a 512-token BPE spells these bytes in several tokens
    stream = TextStream(tok)
    pieces = [stream.push(i) for i in ids]
    pieces.append(stream.flush())
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces), pieces


# --------------------------------------------------------------------------- Hugging Face


@pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None,
    reason="transformers is not installed (the dev extras install it): an export's loading "
    "by Hugging Face tools is not checked",
)
def test_transformers_loads_an_export_and_generates_what_m3run_generate_does(trained, tmp_path):
    out = tmp_path / "export"
    assert invoke("export", trained, out).exit_code == 0
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "m3run_mamba3" and config["architectures"]
    assert set(config["auto_map"]) == {"AutoConfig", "AutoModelForCausalLM"}
    assert config["step"] == 10 and config["vocab_size"] == 512 and config["eos_token_id"] == 0
    assert json.loads((out / "tokenizer_config.json").read_text())["eos_token"] == "<|endoftext|>"

    # A user's process: a folder of their own, m3run installed, Hugging Face's own `kernels`
    # package importable (the checkout's top-level folders are not on the path).
    site, work = tmp_path / "site", tmp_path / "work"
    site.mkdir()
    work.mkdir()
    (site / "m3run").symlink_to(REPO / "m3run")
    env = {k: v for k, v in worker_env().items() if k != "PYTHONPATH"}
    env.update(PYTHONPATH=str(site), HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1")
    code = (
        "import json, sys, m3run\n"
        "from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer\n"
        "out = sys.argv[1]\n"
        "cfg = AutoConfig.from_pretrained(out, trust_remote_code=True)\n"
        "model = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)\n"
        "tok = AutoTokenizer.from_pretrained(out, trust_remote_code=True)\n"
        "inputs = tok('def main(', return_tensors='pt')\n"
        "ids = model.generate(**inputs, max_new_tokens=24, do_sample=False)\n"
        "new = ids[0, inputs.input_ids.shape[1]:]\n"
        "loss = model(inputs.input_ids, labels=inputs.input_ids).loss.item()\n"
        "print(json.dumps({'text': tok.decode(new, skip_special_tokens=True),\n"
        "    'eos': tok.eos_token, 'step': cfg.step, 'loss': loss, 'm3run': m3run.__file__}))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(out)],
        cwd=work,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    hf = json.loads(done.stdout.strip().splitlines()[-1])
    assert Path(hf["m3run"]).resolve().is_relative_to(REPO)
    assert hf["eos"] == "<|endoftext|>" and hf["step"] == 10 and 0 < hf["loss"] < 10
    said = invoke(
        "generate", trained, "--prompt", "def main(", "--temperature", 0, "--max-new-tokens", 24
    )
    assert said.exit_code == 0, said.output
    assert said.output.rstrip("\n") == "def main(" + hf["text"]
