"""The run config schema: recipes, validation messages, overrides, presets, dump and hash, and
keys added after runs were frozen."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import BaseModel

from m3run.model.config import PRESETS, ModelConfig
from m3run.runner.config import (
    ConfigError,
    RunConfig,
    apply_overrides,
    config_hash,
    keep_legacy_values,
    load_config,
    load_frozen_config,
    parse_config,
)
from m3run.runner.files import read_jsonl
from m3run.runner.protocol import EVENTS_FILE
from m3run.runner.supervisor.launch import LaunchError, LaunchOptions, freeze_config

ROOT = Path(__file__).resolve().parents[3]
CONFIGS = ROOT / "configs"
RECIPES = sorted(CONFIGS.glob("*.yaml")) + sorted(CONFIGS.glob("*.yml"))
A100 = CONFIGS / "pretrain_a100_434m.yaml"
DEMO = CONFIGS / "demo_cpu.yaml"

MINIMAL = """\
model: {preset: tiny}
train: {total_steps: 10, micro_batch_size: 2, lr: 1e-3, warmup_steps: 2}
data: {train_path: data/train, seq_len: 16}
checkpoint: {interval_steps: 5}
"""


def _error(text: str = MINIMAL, overrides: list[str] | tuple[str, ...] = ()) -> str:
    with pytest.raises(ConfigError) as info:
        parse_config(text, overrides)
    return str(info.value)


# --- recipes ------------------------------------------------------------------------------


def test_recipes_exist():
    assert A100 in RECIPES and DEMO in RECIPES


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_every_recipe_loads_and_round_trips(path: Path):
    cfg = load_config(path)
    assert isinstance(cfg.model, ModelConfig)
    assert parse_config(cfg.to_yaml()) == cfg
    assert cfg.warnings() == [], "a shipped recipe should not trigger advisories"


def test_a100_recipe_numbers():
    cfg = load_config(A100)
    t = cfg.train
    assert cfg.model_preset == "434m"
    assert cfg.model == ModelConfig.preset("434m")
    assert (t.micro_batch_size, t.grad_accum_steps, cfg.data.seq_len) == (16, 2, 2048)
    assert cfg.global_batch_tokens == 16 * 2 * 2048
    assert (t.lr, t.warmup_steps, t.total_steps) == (3e-4, 2000, 256000)
    assert (t.schedule, t.min_lr_ratio) == ("cosine", 0.05)
    assert (t.beta1, t.beta2, t.weight_decay, t.grad_clip) == (0.9, 0.95, 0.1, 1.0)
    assert (t.precision, t.compile, t.device) == ("bf16", True, "cuda")
    assert (cfg.checkpoint.interval_steps, cfg.checkpoint.keep_last) == (4000, 3)
    assert cfg.log.interval_steps == 50
    assert (cfg.eval.interval_steps, cfg.eval.steps) == (2000, 20)
    assert (cfg.data.train_path, cfg.data.val_path) == (None, "/data/fineweb/val")
    mix = {Path(s.path).parent.name: s.weight for s in cfg.data.sources}
    assert mix == {
        "fineweb-edu": 0.50,
        "fineweb": 0.20,
        "the-stack-python": 0.15,
        "openmath": 0.10,
        "arxiv": 0.05,
    }


def test_demo_recipe_numbers():
    cfg = load_config(DEMO)
    t = cfg.train
    assert cfg.model == ModelConfig.preset("tiny")
    assert (cfg.data.train_path, cfg.data.val_path) == (
        str(ROOT / "runs/demo-data/train"),
        str(ROOT / "runs/demo-data/val"),
    )
    assert (cfg.data.seq_len, t.micro_batch_size, t.grad_accum_steps) == (256, 8, 1)
    assert (t.total_steps, t.lr, t.warmup_steps, t.schedule, t.min_lr_ratio) == (
        300,
        3e-3,
        30,
        "cosine",
        0.1,
    )
    assert (t.precision, t.device, t.compile, t.seed) == ("fp32", "cpu", False, 1234)
    assert (cfg.checkpoint.interval_steps, cfg.checkpoint.keep_last, cfg.log.interval_steps) == (
        50,
        3,
        10,
    )
    assert (cfg.eval.interval_steps, cfg.eval.steps) == (100, 4)


# --- schema hygiene -------------------------------------------------------------------------


def _sections(cls: type[BaseModel], seen: set | None = None):
    seen = set() if seen is None else seen
    if cls in seen:
        return
    seen.add(cls)
    yield cls
    for field in cls.model_fields.values():
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            yield from _sections(field.annotation, seen)


@pytest.mark.parametrize("cls", list(_sections(RunConfig)), ids=lambda c: c.__name__)
def test_every_section_forbids_extra_keys_and_documents_every_field(cls: type[BaseModel]):
    assert cls.model_config.get("extra") == "forbid"
    undocumented = [name for name, f in cls.model_fields.items() if not f.description]
    assert undocumented == []


def test_supervisor_defaults():
    cfg = parse_config(MINIMAL)
    t, s = cfg.train, cfg.supervisor
    assert (t.grad_accum_steps, t.min_lr_ratio, t.decay_fraction) == (1, 0.1, 0.2)
    assert (t.beta1, t.beta2, t.eps, t.weight_decay, t.grad_clip) == (0.9, 0.95, 1e-8, 0.1, 1.0)
    assert (t.precision, t.device, t.compile, t.compile_mode) == ("auto", "auto", False, None)
    assert t.activation_checkpointing is False
    assert (t.nan_max_consecutive, t.nan_lr_factor, t.nan_max_rollbacks) == (3, 0.5, 3)
    assert (cfg.data.val_path, cfg.data.prefetch, cfg.data.reset_at_eos) == (None, 2, True)
    assert (cfg.checkpoint.keep_last, cfg.checkpoint.save_on_exit) == (3, True)
    assert cfg.eval.interval_steps == 0
    assert cfg.log.heartbeat_interval_s == 2.0
    assert (s.max_restarts, s.restart_window_s, s.no_progress_restarts) == (10, 3600, 3)
    assert (s.backoff_initial_s, s.backoff_max_s, s.startup_timeout_s) == (2.0, 300.0, 900)
    assert (s.heartbeat_timeout_s, s.heartbeat_safety_factor, s.stop_grace_s) == (None, 5.0, 120)
    assert (s.nan_lr_factor, s.preemption_provider, s.preemption_poll_s) == (0.5, "auto", 5.0)
    assert (s.metadata_url, s.smoke, s.vram_warn_fraction) == (None, True, 0.95)


def test_config_is_frozen():
    cfg = parse_config(MINIMAL)
    with pytest.raises(ValueError):
        cfg.train.lr = 1.0  # type: ignore[misc]


# --- validation messages --------------------------------------------------------------------


def test_warmup_zero_is_rejected_with_a_named_fix():
    msg = _error(overrides=["train.warmup_steps=0"])
    assert "train.warmup_steps: must be ≥ 1, got 0" in msg
    assert "fix: set train.warmup_steps to a positive number of steps" in msg
    assert "[from override train.warmup_steps=0]" in msg


def test_warmup_may_exceed_total_steps_with_an_advisory():
    cfg = parse_config(MINIMAL, ["train.warmup_steps=50"])
    assert cfg.train.warmup_steps == 50
    assert any("ends during warmup" in w for w in cfg.warnings())


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("train.lr=0", "train.lr: must be > 0, got 0"),
        ("train.min_lr_ratio=1.5", "train.min_lr_ratio: must be ≤ 1, got 1.5"),
        ("train.total_steps=2.5", "train.total_steps: must be a whole number, got 2.5"),
        ("train.lr=fast", "train.lr: must be a number, got 'fast'"),
        ("train.lr=.inf", "train.lr: must be a finite number"),
        ("train.compile=maybe", "train.compile: must be true or false, got 'maybe'"),
        ("data.seq_len=1", "data.seq_len: must be ≥ 2, got 1"),
        ("train.nan_lr_factor=0", "train.nan_lr_factor: must be > 0, got 0"),
        ("supervisor.vram_warn_fraction=1.2", "supervisor.vram_warn_fraction: must be ≤ 1"),
    ],
)
def test_bad_values_name_key_value_and_fix(override: str, expected: str):
    msg = _error(overrides=[override])
    assert expected in msg
    assert "(fix: " in msg


def test_unknown_key_suggests_the_closest():
    msg = _error(overrides=["train.warmup_step=5"])
    assert "unknown key train.warmup_step — did you mean train.warmup_steps?" in msg
    text = MINIMAL.replace("model: {preset: tiny}", "model: {preset: tiny, d_modle: 64}")
    assert "unknown key model.d_modle — did you mean model.d_model?" in _error(text)


def test_unknown_section_in_file_suggests_the_closest():
    msg = _error(MINIMAL + "chekpoint: {keep_last: 2}\n")
    assert "unknown section chekpoint — did you mean checkpoint?" in msg


def test_unknown_key_without_a_close_match_lists_valid_keys():
    msg = _error(overrides=["log.zzz=1"])
    assert "unknown key log.zzz" in msg and "valid keys: interval_steps" in msg


def test_bad_choice_lists_the_choices():
    msg = _error(overrides=["train.schedule=cosin"])
    assert "train.schedule: must be one of 'cosine', 'wsd', got 'cosin'" in msg
    assert "did you mean cosine?" in msg
    assert "train.compile_mode" in _error(overrides=["train.compile_mode=max-autotun"])


@pytest.mark.parametrize("mode", ["reduce-overhead", "max-autotune"])
def test_compile_modes_that_capture_cuda_graphs_are_refused_with_the_alternative(mode):
    # On a GPU the step's first backward fails under them (accumulated gradients are a graph's
    # outputs that its next replay overwrites); the config says so before any startup cost.
    msg = _error(overrides=[f"train.compile_mode={mode}"])
    assert f"train.compile_mode={mode} captures CUDA graphs" in msg
    assert "fix: set train.compile_mode to default, or to max-autotune-no-cudagraphs" in msg


def test_missing_required_fields_and_sections():
    msg = _error(MINIMAL.replace("lr: 1e-3, ", ""))
    assert "train.lr: required but missing (fix: add `lr:` under `train:`)" in msg
    msg = _error("")
    for section in ("model", "train", "data", "checkpoint"):
        assert f"{section}: required section is missing" in msg


def test_all_problems_are_reported_at_once():
    msg = _error(overrides=["train.lr=0", "data.seq_len=1"])
    assert "train.lr:" in msg and "data.seq_len:" in msg


def test_eval_without_val_path_is_rejected():
    msg = _error(overrides=["eval.interval_steps=5"])
    assert "eval.interval_steps is 5 but data.val_path is not set" in msg
    cfg = parse_config(MINIMAL, ["eval.interval_steps=5", "data.val_path=data/val"])
    assert cfg.eval.interval_steps == 5


def test_supervisor_cross_checks():
    msg = _error(overrides=["supervisor.backoff_initial_s=1000"])
    assert "supervisor.backoff_initial_s (1000.0) must be ≤ supervisor.backoff_max_s" in msg
    msg = _error(overrides=["supervisor.heartbeat_timeout_s=1"])
    assert "must exceed log.heartbeat_interval_s" in msg
    assert "http(s) URL" in _error(overrides=["supervisor.metadata_url=metadata.local"])
    cfg = parse_config(MINIMAL, ["supervisor.metadata_url=http://127.0.0.1:8080"])
    assert cfg.supervisor.metadata_url == "http://127.0.0.1:8080"


def test_model_shape_errors_come_through():
    msg = _error(overrides=["model.headdim=48"])
    assert msg.count("model:") == 1 and "divisible by headdim" in msg


def test_missing_file_names_the_path(tmp_path: Path):
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match="config file not found") as info:
        load_config(missing)
    assert str(missing) in str(info.value)
    with pytest.raises(ConfigError, match="is a directory"):
        load_config(tmp_path)


def test_bad_yaml_and_non_mapping_name_the_file(tmp_path: Path):
    path = tmp_path / "broken.yaml"
    path.write_text("train: [1, 2\n")
    with pytest.raises(ConfigError, match=r"invalid YAML in .*broken\.yaml"):
        load_config(path)
    path.write_text("- just\n- a list\n")
    with pytest.raises(ConfigError, match="must be a YAML mapping of sections"):
        load_config(path)


def test_duplicate_yaml_keys_are_rejected():
    msg = _error(MINIMAL + "checkpoint: {interval_steps: 7}\n")
    assert "duplicate key 'checkpoint'" in msg


# --- overrides ------------------------------------------------------------------------------


def test_overrides_are_typed():
    cfg = parse_config(
        MINIMAL,
        ["train.lr=1e-4", "train.compile=true", "train.total_steps=20", "data.val_path=null"],
    )
    assert isinstance(cfg.train.lr, float) and cfg.train.lr == 1e-4
    assert cfg.train.compile is True
    assert isinstance(cfg.train.total_steps, int) and cfg.train.total_steps == 20
    assert cfg.data.val_path is None


def test_exponent_floats_in_files_are_numbers():
    # PyYAML alone reads `lr: 1e-3` as the string "1e-3".
    cfg = parse_config(MINIMAL.replace("lr: 1e-3", "lr: 2E-3"))
    assert cfg.train.lr == 2e-3


def test_override_values_that_are_not_yaml_stay_strings():
    cfg = parse_config(MINIMAL, ["data.train_path=@shards/train", "data.val_path=s3://b/val"])
    assert (cfg.data.train_path, cfg.data.val_path) == ("@shards/train", "s3://b/val")


def test_later_overrides_win():
    assert parse_config(MINIMAL, ["train.lr=1", "train.lr=2"]).train.lr == 2.0


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("train.lr", "has no '='"),
        ("lr=1e-4", "exactly one dot"),
        ("train.lr.x=1", "exactly one dot"),
        (".lr=1", "exactly one dot"),
        ("trian.lr=1", "unknown section 'trian' — did you mean train?"),
    ],
)
def test_malformed_overrides_are_config_errors(override: str, expected: str):
    assert expected in _error(overrides=[override])


def test_apply_overrides_on_a_loaded_config():
    cfg = parse_config(MINIMAL)
    new = apply_overrides(cfg, ["train.lr=5e-4", "checkpoint.keep_last=1"])
    assert (new.train.lr, new.checkpoint.keep_last) == (5e-4, 1)
    assert cfg.train.lr == 1e-3  # the original is untouched
    assert apply_overrides(cfg, []) == cfg
    with pytest.raises(ConfigError, match=r"train\.warmup_steps: must be ≥ 1, got 0"):
        apply_overrides(cfg, ["train.warmup_steps=0"])


def test_a_single_override_string_is_one_override():
    assert parse_config(MINIMAL, "train.lr=0.5").train.lr == 0.5  # type: ignore[arg-type]


# --- presets --------------------------------------------------------------------------------


def test_preset_expands_and_keys_override():
    text = MINIMAL.replace("{preset: tiny}", "{preset: tiny, d_model: 64, n_layers: 3}")
    cfg = parse_config(text)
    assert cfg.model == ModelConfig.preset("tiny", d_model=64, n_layers=3)
    assert cfg.model_preset == "tiny"
    cfg = parse_config(MINIMAL, ["model.d_model=96"])
    assert cfg.model == ModelConfig.preset("tiny", d_model=96)


def test_preset_override_switches_the_preset():
    cfg = parse_config(MINIMAL, ["model.preset=125m"])
    assert cfg.model == ModelConfig.preset("125m") and cfg.model_preset == "125m"


def test_preset_override_on_a_resolved_config_keeps_only_real_customisations():
    base = parse_config(MINIMAL, ["model.preset=434m", "model.n_layers=4"])
    dumped = base.to_yaml()  # lists every model field
    cfg = parse_config(dumped, ["model.preset=tiny"])
    assert cfg.model == ModelConfig.preset("tiny", n_layers=4)
    assert apply_overrides(base, ["model.preset=tiny"]) == cfg


def test_unknown_preset_suggests_the_closest():
    msg = _error(overrides=["model.preset=tinyy"])
    assert "model.preset: unknown preset 'tinyy' — did you mean tiny?" in msg
    assert all(name in msg for name in PRESETS)


def test_model_shorthand_and_explicit_fields():
    cfg = parse_config(MINIMAL.replace("{preset: tiny}", "tiny"))
    assert cfg.model == ModelConfig.preset("tiny") and cfg.model_preset == "tiny"
    explicit = "model:\n" + "".join(f"  {k}: {v}\n" for k, v in PRESETS["tiny"].items())
    cfg2 = parse_config(MINIMAL.replace("model: {preset: tiny}\n", explicit))
    assert cfg2.model == cfg.model and cfg2.model_preset is None
    assert "preset" not in cfg2.model_dump()["model"]
    assert parse_config(cfg2.to_yaml()) == cfg2


# --- dump and hash --------------------------------------------------------------------------


def test_dump_keeps_the_preset_and_every_field():
    cfg = parse_config(MINIMAL, ["model.d_model=64"])
    dumped = cfg.model_dump()
    assert dumped["model"]["preset"] == "tiny"
    assert set(ModelConfig.model_fields) <= set(dumped["model"])
    assert dumped["model"]["d_model"] == 64
    assert RunConfig.model_validate(dumped) == cfg


def test_dump_load_round_trip_via_file(tmp_path: Path):
    # A frozen config's data paths are absolute (a relative one in a file is the file's).
    sets = ["train.schedule=wsd", "train.compile_mode=default", "data.train_path=/data/train"]
    cfg = parse_config(MINIMAL, sets)
    path = tmp_path / "config.yaml"
    path.write_text(cfg.to_yaml())
    again = load_config(path)
    assert again == cfg
    assert config_hash(again) == config_hash(cfg)


def test_config_hash_is_stable_and_sensitive():
    cfg = parse_config(MINIMAL)
    h = config_hash(cfg)
    assert len(h) == 64 and int(h, 16) >= 0
    assert config_hash(parse_config(MINIMAL)) == h
    assert config_hash(apply_overrides(cfg, ["train.lr=2e-3"])) != h
    assert config_hash(apply_overrides(cfg, ["model.d_model=64"])) != h


def test_config_hash_is_the_same_in_another_process():
    code = (
        "from m3run.runner.config import load_config, config_hash;"
        f"print(config_hash(load_config({str(A100)!r})))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == config_hash(load_config(A100))


# --- keys added after runs were frozen ------------------------------------------------------


def test_reset_at_eos_is_on_for_new_runs_and_in_the_hash():
    cfg = parse_config(MINIMAL)
    assert cfg.data.reset_at_eos is True
    assert all(load_config(path).data.reset_at_eos for path in RECIPES)
    assert config_hash(apply_overrides(cfg, ["data.reset_at_eos=false"])) != config_hash(cfg)


def test_compile_scope_is_blocks_for_new_runs_and_in_the_hash():
    cfg = parse_config(MINIMAL)
    assert cfg.train.compile_scope == "blocks"
    assert config_hash(apply_overrides(cfg, ["train.compile_scope=model"])) != config_hash(cfg)
    with pytest.raises(ConfigError, match=r"train\.compile_scope"):
        apply_overrides(cfg, ["train.compile_scope=layers"])


# The keys each added after runs were frozen, with the value such a run reads and its new default.
LEGACY = [
    ("data", "reset_at_eos", False, True),
    ("train", "compile_scope", "model", "blocks"),
    ("train", "deterministic", False, False),
    ("supervisor", "tune_scan", False, True),
    ("model", "A_activation", "softplus", "heavy_tail"),
    ("checkpoint", "snapshot_buffers", 2, 2),
]


def test_deterministic_is_off_by_default_and_in_the_hash_only_when_on():
    cfg = parse_config(MINIMAL)
    on = apply_overrides(cfg, ["train.deterministic=true"])
    assert cfg.train.deterministic is False and on.train.deterministic is True
    assert config_hash(on) != config_hash(cfg)
    dump = cfg.model_dump(mode="json")  # off, it hashes as configs did before the key existed
    assert "deterministic" in dump["train"]
    del dump["train"]["deterministic"], dump["train"]["compile_scope"]
    del dump["checkpoint"]["snapshot_buffers"]  # at its legacy value, as every key above
    assert (
        config_hash(apply_overrides(cfg, ["train.compile_scope=model"]))
        == hashlib.sha256(
            json.dumps(dump, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
        ).hexdigest()
    )


def _frozen_before_new_keys(run_dir: Path) -> str:
    """Turn RUN_DIR/config.yaml into one frozen before any LEGACY key existed; its text."""
    path = run_dir / "config.yaml"
    lines = path.read_text().splitlines(keepends=True)
    names = tuple(f"{name}:" for _, name, _, _ in LEGACY)
    old = "".join(line for line in lines if not line.strip().startswith(names))
    assert len(old.splitlines()) == len(lines) - len(LEGACY)
    path.write_text(old)
    return old


def test_a_run_frozen_before_the_new_keys_reads_their_old_values_with_its_old_hash(tmp_path):
    (tmp_path / "config.yaml").write_text(load_config(DEMO).to_yaml())
    _frozen_before_new_keys(tmp_path)
    old = load_frozen_config(tmp_path / "config.yaml")
    as_recipe = load_config(tmp_path / "config.yaml")
    dump = old.model_dump(mode="json")
    for section, name, legacy, new in LEGACY:
        assert getattr(getattr(old, section), name) == legacy
        assert getattr(getattr(as_recipe, section), name) == new
        del dump[section][name]
    # Its hash is the one computed before the keys existed: over the dump without them.
    canonical = json.dumps(dump, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    assert config_hash(old) == hashlib.sha256(canonical.encode()).hexdigest()
    # A recipe that leaves a key unset keeps the old value; one that sets it is a change.
    kept = keep_legacy_values(load_config(DEMO), old)
    assert (kept.data.reset_at_eos, kept.train.compile_scope) == (False, "model")
    on = load_config(DEMO, ["data.reset_at_eos=true", "train.compile_scope=blocks"])
    kept = keep_legacy_values(on, old)
    assert (kept.data.reset_at_eos, kept.train.compile_scope) == (True, "blocks")


def test_relaunching_a_run_frozen_before_reset_at_eos_is_no_config_change(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    opts = LaunchOptions(config=DEMO, run_dir=run_dir)
    freeze_config(opts)
    _frozen_before_new_keys(run_dir)
    old_hash = config_hash(load_frozen_config(run_dir / "config.yaml"))
    for _ in range(2):  # the first relaunch writes the key (false); the second reads it
        cfg, chash = freeze_config(opts)
        assert cfg.data.reset_at_eos is False and chash == old_hash
        assert "reset_at_eos: false" in (run_dir / "config.yaml").read_text()
    assert not (run_dir / EVENTS_FILE).exists() or not [
        e for e in read_jsonl(run_dir / EVENTS_FILE) if e["event"] == "config_replaced"
    ]
    # Turning resets on for that run is a config change like any other.
    on = LaunchOptions(config=DEMO, run_dir=run_dir, overrides=["data.reset_at_eos=true"])
    with pytest.raises(LaunchError, match=r"data\.reset_at_eos: False -> True"):
        freeze_config(on)
    on.force = True
    assert freeze_config(on)[0].data.reset_at_eos is True


# --- data paths -----------------------------------------------------------------------------


def test_relative_data_paths_in_a_file_are_relative_to_the_file_from_any_directory(
    tmp_path, monkeypatch
):
    recipes, elsewhere = tmp_path / "recipes", tmp_path / "elsewhere"
    recipes.mkdir()
    elsewhere.mkdir()
    one = MINIMAL.replace("data/train", "../shards/train, val_path: /abs/val")
    (recipes / "one.yaml").write_text(one)
    mix = MINIMAL.replace(
        "train_path: data/train",
        "sources: [{path: a/train, weight: 1}, {path: /b/train, weight: 1}]",
    )
    (recipes / "mix.yaml").write_text(mix)
    monkeypatch.chdir(elsewhere)
    cfg = load_config(Path("../recipes/one.yaml"))
    assert (cfg.data.train_path, cfg.data.val_path) == (str(tmp_path / "shards/train"), "/abs/val")
    paths = [s.path for s in load_config(recipes / "mix.yaml").data.sources]
    assert paths == [str(recipes / "a/train"), "/b/train"]
    # A path given with --set is the shell's: relative to the working directory.
    cfg = load_config(recipes / "one.yaml", ["data.val_path=here/val", "data.train_path=~/t"])
    assert cfg.data.val_path == str(elsewhere / "here/val")
    assert cfg.data.train_path == str(Path.home() / "t")


def test_the_demo_recipe_reads_the_repositorys_demo_data_from_any_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_config(DEMO)
    assert cfg.data.train_path == str(ROOT / "runs" / "demo-data" / "train")
    assert cfg.data.val_path == str(ROOT / "runs" / "demo-data" / "val")


def test_a_run_frozen_with_relative_paths_relaunches_from_its_directory_unchanged(
    tmp_path, monkeypatch
):
    """Before data paths were made absolute, a frozen config kept them as written, relative to
    the launch's working directory: read so, a relaunch from there is no config change, and
    the config it freezes again is absolute."""
    monkeypatch.chdir(tmp_path)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    sets = ["data.train_path=corpus/train", "data.val_path=corpus/val"]
    frozen = load_config(DEMO, sets).to_yaml()
    old = frozen.replace(str(tmp_path / "corpus") + "/", "corpus/")
    assert "train_path: corpus/train" in old
    (run_dir / "config.yaml").write_text(old)
    assert load_frozen_config(run_dir / "config.yaml").data.train_path == str(
        tmp_path / "corpus" / "train"
    )
    cfg, _ = freeze_config(LaunchOptions(config=DEMO, run_dir=run_dir, overrides=sets))
    assert cfg.data.train_path == str(tmp_path / "corpus" / "train")
    assert f"train_path: {tmp_path / 'corpus' / 'train'}" in (run_dir / "config.yaml").read_text()


# --- helpers --------------------------------------------------------------------------------


def test_device_and_precision_resolution():
    t = parse_config(MINIMAL).train
    assert t.resolve_device(cuda_available=True) == "cuda"
    assert t.resolve_device(cuda_available=False) == "cpu"
    assert (t.resolve_precision("cuda"), t.resolve_precision("cpu")) == ("bf16", "fp32")
    cuda = parse_config(MINIMAL, ["train.device=cuda", "train.precision=fp32"]).train
    assert cuda.resolve_precision("cuda") == "fp32"
    with pytest.raises(ConfigError, match=r"train\.device is cuda but no CUDA device is visible"):
        cuda.resolve_device(cuda_available=False)


def test_warnings_flag_likely_mistakes():
    cfg = parse_config(MINIMAL, ["train.compile_mode=default", "data.val_path=v"])
    notes = "\n".join(cfg.warnings())
    assert "compile_mode=default is ignored" in notes
    assert "no evaluation will run" in notes
    wsd = parse_config(MINIMAL, ["train.schedule=wsd", "train.warmup_steps=9"])
    assert any("no stable phase" in w for w in wsd.warnings())
    assert parse_config(MINIMAL).warnings() == []


def test_importing_the_config_does_not_import_torch():
    code = "import m3run.runner.config, sys; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


@pytest.mark.parametrize("key", ["train.micro_batch_size", "train.lr", "checkpoint.keep_last"])
def test_a_boolean_is_not_a_number(key):
    with pytest.raises(ConfigError, match=rf"{key}: must be a number, got the boolean True"):
        load_config(DEMO, [f"{key}=yes"])


# --- oversized and deeply nested files -------------------------------------------------------


def test_deeply_nested_yaml_is_a_config_error_not_a_recursion_error():
    deep = "model: " + "[" * 5000 + "]" * 5000 + "\n"
    message = _error(deep)
    assert "nests mappings or lists more than" in message and "fix:" in message


def test_oversized_config_file_is_refused_before_parsing(tmp_path):
    from m3run.runner.config.loading import MAX_CONFIG_BYTES

    path = tmp_path / "big.yaml"
    path.write_text(MINIMAL + "# padding\n" * (MAX_CONFIG_BYTES // 10 + 1))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert f"larger than {MAX_CONFIG_BYTES // 2**20} MiB" in str(info.value)
