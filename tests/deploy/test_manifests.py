"""The container and deployment manifests keep the supervisor's contract: grace periods that cover
a checkpoint save, exit-code handling that matches runner/protocol.py, a non-root image with tini
and SIGTERM, and health checks that call a command the CLI really has.

No Docker engine, cluster or systemd instance is needed: the files are parsed and checked."""

from __future__ import annotations

import configparser
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from runner.cli import app
from runner.config import load_config
from runner.protocol import (
    EXIT_CONFIG,
    EXIT_OK,
    EXIT_SOFTWARE,
    EXIT_STOPPED,
    EXIT_UNAVAILABLE,
)

REPO = Path(__file__).resolve().parents[2]
RECIPE = "configs/pretrain_a100_434m.yaml"
RUN_DIR = "/runs/pretrain_a100_434m"
# Codes after which starting the same run again cannot help (DESIGN.md, "Exit codes").
VERDICTS = {EXIT_UNAVAILABLE, EXIT_SOFTWARE, EXIT_CONFIG}
# Beyond the save and the mirror flush: the supervisor's poll, process exit, the runtime's own
# bookkeeping.
MARGIN_S = 30.0


@pytest.fixture(scope="module")
def needed_grace_s() -> float:
    """What a stop must allow before SIGKILL for the A100 recipe: the worker's save window plus
    the wait for the newest checkpoint to reach the mirror."""
    cfg = load_config(REPO / RECIPE)
    return cfg.supervisor.stop_grace_s + cfg.checkpoint.mirror_flush_s + MARGIN_S


def duration_s(text: str | int | float) -> float:
    """A compose/systemd duration ('5m', '1m30s', '300s', 300) in seconds."""
    if isinstance(text, (int, float)):
        return float(text)
    parts = re.findall(r"(\d+(?:\.\d+)?)\s*(h|min|m|s|ms|us)?", text.strip())
    assert parts and "".join(n + (u or "") for n, u in parts) == text.replace(" ", ""), text
    scale = {"h": 3600, "min": 60, "m": 60, "s": 1, "ms": 1e-3, "us": 1e-6, "": 1}
    return sum(float(n) * scale[u] for n, u in parts)


def assert_launches_recipe(argv: list[str], run_dir: str) -> None:
    """argv (after `m3run`) launches the A100 recipe into run_dir, and its --set overrides
    (with empty environment substitutions) validate against it."""
    assert argv[:2] == ["launch", RECIPE], argv
    assert (REPO / RECIPE).is_file()
    assert argv[argv.index("--run-dir") + 1] == run_dir
    sets = [argv[i + 1] for i, a in enumerate(argv) if a == "--set"]
    sets = [re.sub(r"\$\{[^}]*\}|\$\([^)]*\)|\$\w+", "", s) for s in sets]
    load_config(REPO / RECIPE, sets)


# --------------------------------------------------------------------------- Dockerfile


def dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out, buf = [], ""
    for line in (REPO / "Dockerfile").read_text().splitlines():
        if line.strip().startswith("#") and not buf:
            continue
        buf += line.rstrip("\\").strip() + " "
        if not line.rstrip().endswith("\\"):
            if buf.strip():
                word, _, rest = buf.strip().partition(" ")
                out.append((word.upper(), rest.strip()))
            buf = ""
    return out


def instruction(name: str) -> list[str]:
    return [args for word, args in dockerfile() if word == name]


def exec_form(args: str) -> list[str]:
    value = yaml.safe_load(args)  # a JSON array is YAML
    assert isinstance(value, list), f"{args!r} is not exec form"
    return value


def test_image_runs_as_a_non_root_user():
    users = instruction("USER")
    assert users, "the Dockerfile never switches away from root"
    assert users[-1] not in ("root", "0") and not users[-1].startswith(("root:", "0:"))
    assert re.search(r"useradd\b.*\b" + re.escape(users[-1]) + r"\b", " ".join(instruction("RUN")))


def test_image_stops_with_sigterm_through_tini():
    assert instruction("STOPSIGNAL") == ["SIGTERM"]
    entry = exec_form(instruction("ENTRYPOINT")[-1])
    assert Path(entry[0]).name == "tini" and entry[1] == "--"
    assert re.search(r"apt-get install[^&]*\btini\b", " ".join(instruction("RUN")))
    # the program tini runs is the repo's wrapper, installed from docker/
    assert Path(entry[2]).name == "m3run-entrypoint"
    assert "docker/entrypoint /usr/local/bin/m3run-entrypoint" in " ".join(instruction("RUN"))


def test_image_default_is_the_a100_launch_and_the_healthcheck_watches_that_run():
    assert_launches_recipe(exec_form(instruction("CMD")[-1]), RUN_DIR)
    (health,) = instruction("HEALTHCHECK")
    cmd = exec_form(health.split("CMD", 1)[1].strip())
    assert cmd == ["m3run", "health", "--liveness", RUN_DIR]
    assert set(exec_form(instruction("VOLUME")[-1])) == {"/data", "/runs"}


def test_image_keeps_the_base_torch():
    pip = [r for r in instruction("RUN") if "pip install" in r]
    assert len(pip) == 1
    # pinned to the base image's build, so pip can only keep it, never replace it
    assert "--constraint /tmp/keep-torch.txt" in pip[0] and "torch.__version__" in pip[0]
    assert not re.search(r"pip install[^&]*\btorch\b(?!\.)", pip[0].replace("keep-torch", ""))


def test_build_context_leaves_out_local_state():
    ignored = (REPO / ".dockerignore").read_text().split()
    for entry in (".*", "runs", "data", "tests", "**/__pycache__"):
        assert entry in ignored
    assert "!.dockerignore" in ignored


def test_docker_run_line_documents_gpus_and_a_long_enough_stop_timeout(needed_grace_s):
    runs = re.findall(
        r"docker run\b[^\n]*(?:\\\n[^\n]*)*", (REPO / "docker" / "README.md").read_text()
    )
    documented = [r for r in runs if "--gpus all" in r and "--stop-timeout" in r]
    assert documented, "docker/README.md shows no `docker run --gpus all --stop-timeout` line"
    for line in documented:
        timeout = int(re.search(r"--stop-timeout[ =](\d+)", line).group(1))
        assert timeout >= needed_grace_s, line


# --------------------------------------------------------------------------- compose


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((REPO / "compose.yaml").read_text())


def test_compose_train_service(compose, needed_grace_s):
    train = compose["services"]["train"]
    assert_launches_recipe(train["command"], RUN_DIR)
    assert train["restart"] == "on-failure"  # the entrypoint latches 69/70/78 (tested below)
    assert train["stop_signal"] == "SIGTERM"
    assert duration_s(train["stop_grace_period"]) >= needed_grace_s
    shm = re.fullmatch(r"(\d+)(gb|g)", str(train["shm_size"]).lower())
    assert shm and int(shm.group(1)) >= 1
    (gpu,) = train["deploy"]["resources"]["reservations"]["devices"]
    assert gpu["driver"] == "nvidia" and "gpu" in gpu["capabilities"]
    assert train["healthcheck"]["test"] == ["CMD", "m3run", "health", "--liveness", RUN_DIR]
    assert {v["target"] for v in train["volumes"]} == {"/data", "/runs"}
    assert all(v["bind"]["create_host_path"] is False for v in train["volumes"])
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL"):
        assert name in train["environment"]


def test_compose_prepare_is_a_profile_that_never_restarts(compose):
    prepare = compose["services"]["prepare"]
    assert prepare["profiles"] == ["prepare"]
    assert prepare["restart"] == "no"
    assert prepare["command"][0] == "prepare-data"
    assert prepare["command"][prepare["command"].index("--out") + 1] == "/data/fineweb"
    # what the A100 recipe reads is what prepare writes
    cfg = load_config(REPO / RECIPE)
    assert "/data/fineweb/train" in [s.path for s in cfg.data.sources]
    assert cfg.data.val_path == "/data/fineweb/val"
    assert "deploy" not in prepare  # CPU only


# --------------------------------------------------------------------------- Kubernetes


@pytest.fixture(scope="module")
def k8s() -> dict[str, dict]:
    docs = list(yaml.safe_load_all((REPO / "deploy" / "kubernetes" / "job.yaml").read_text()))
    return {d["kind"]: d for d in docs if d}


def test_k8s_job_grace_restart_and_probe(k8s, needed_grace_s):
    job = k8s["Job"]["spec"]
    pod = job["template"]["spec"]
    assert pod["restartPolicy"] == "Never"  # podFailurePolicy requires it
    assert pod["terminationGracePeriodSeconds"] >= needed_grace_s
    assert job["podReplacementPolicy"] == "Failed"
    (c,) = pod["containers"]
    assert_launches_recipe(c["args"], RUN_DIR)
    assert c["livenessProbe"]["exec"]["command"] == ["m3run", "health", "--liveness", RUN_DIR]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["M3RUN_SIGNAL_EXIT"] == str(EXIT_STOPPED)
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"]
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    claims = {
        v["name"]: v.get("persistentVolumeClaim", {}).get("claimName") for v in pod["volumes"]
    }
    assert claims[mounts["/runs"]] == k8s["PersistentVolumeClaim"]["metadata"]["name"]
    shm = next(v for v in pod["volumes"] if v["name"] == mounts["/dev/shm"])
    assert shm["emptyDir"]["medium"] == "Memory"


def test_k8s_pod_failure_policy_matches_the_exit_codes(k8s):
    job = k8s["Job"]["spec"]
    container = job["template"]["spec"]["containers"][0]["name"]
    by_action: dict[str, set[int]] = {}
    for rule in job["podFailurePolicy"]["rules"]:
        codes = rule.get("onExitCodes")
        if codes is None:
            continue
        assert codes["containerName"] == container and codes["operator"] == "In"
        by_action.setdefault(rule["action"], set()).update(codes["values"])
    assert by_action == {"FailJob": VERDICTS, "Ignore": {EXIT_STOPPED}}
    assert EXIT_OK not in set().union(*by_action.values())  # k8s forbids 0 with operator In
    disruption = [r for r in job["podFailurePolicy"]["rules"] if "onPodConditions" in r]
    assert [(r["action"], r["onPodConditions"][0]["type"]) for r in disruption] == [
        ("Ignore", "DisruptionTarget")
    ]


# --------------------------------------------------------------------------- SkyPilot


def test_skypilot_spot_job_recovers_on_75_and_mirrors_checkpoints():
    task = yaml.safe_load((REPO / "deploy" / "skypilot" / "pretrain-spot.yaml").read_text())
    res = task["resources"]
    assert res["use_spot"] is True
    assert res["accelerators"].startswith("A100")
    rec = res["job_recovery"]
    assert rec["recover_on_exit_codes"] == [EXIT_STOPPED]
    retries = rec["max_restarts_on_errors"]
    assert isinstance(retries, int) and 0 <= retries <= 3  # bounded: 70/78 are retried too
    run = task["run"]
    launch = shlex.split(run[run.index("m3run launch") :].replace("\\\n", " "))
    assert_launches_recipe(launch[1:], "$HOME/runs/pretrain_a100_434m")
    assert "checkpoint.mirror_url=$M3RUN_MIRROR_URL" in launch
    assert "M3RUN_MIRROR_URL" in task["envs"]
    # the data the recipe reads is mounted where it reads it
    assert "/data/fineweb" in task["file_mounts"]


# --------------------------------------------------------------------------- systemd


@pytest.fixture(scope="module")
def unit() -> configparser.ConfigParser:
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str  # systemd keys are case-sensitive
    parser.read(REPO / "deploy" / "systemd" / "m3run.service")
    return parser


def test_systemd_unit_restart_and_stop_semantics(unit, needed_grace_s):
    svc = unit["Service"]
    assert svc["Restart"] == "on-failure"
    assert {int(c) for c in svc["RestartPreventExitStatus"].split()} == VERDICTS
    assert svc["KillSignal"] == "SIGTERM"
    assert svc["KillMode"] == "mixed"  # SIGTERM to the supervisor only; it stops the worker
    assert duration_s(svc["TimeoutStopSec"]) >= needed_grace_s
    assert svc["User"] not in ("root", "0")
    argv = shlex.split(svc["ExecStart"])
    assert Path(argv[0]).name == "m3run"
    assert_launches_recipe(argv[1:], "/srv/m3run/runs/pretrain_a100_434m")


def test_systemd_unit_passes_systemd_analyze(tmp_path):
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed on this machine")
    text = (REPO / "deploy" / "systemd" / "m3run.service").read_text()
    # The venv of the unit does not exist here; verify the unit with an executable that does.
    text = re.sub(r"^ExecStart=\S+", "ExecStart=/bin/true", text, flags=re.M)
    path = tmp_path / "m3run.service"
    path.write_text(text)
    r = subprocess.run(["systemd-analyze", "verify", str(path)], capture_output=True, text=True)
    assert r.returncode == 0 and not r.stderr.strip() and not r.stdout.strip(), r.stderr


# --------------------------------------------------------------------------- the CLI they call


def commands_used() -> set[str]:
    """Every `m3run <command>` the manifests run."""
    used = {exec_form(instruction("CMD")[-1])[0]}
    compose = yaml.safe_load((REPO / "compose.yaml").read_text())
    used |= {s["command"][0] for s in compose["services"].values()}
    used |= {
        s["healthcheck"]["test"][2] for s in compose["services"].values() if "healthcheck" in s
    }
    return used


def test_liveness_check_is_a_real_cli_option():
    r = CliRunner().invoke(app, ["health", "--help"])
    assert r.exit_code == 0, r.output
    assert "--liveness" in r.output


@pytest.mark.parametrize("command", sorted(commands_used()))
def test_every_command_the_manifests_run_exists(command):
    listed = CliRunner().invoke(app, ["--help"]).output
    if command == "prepare-data" and "prepare-data" not in listed:
        pytest.xfail(
            "`m3run prepare-data` is not in runner/cli.py yet (compose's prepare "
            "service and runner/data/'s messages call it)"
        )
    r = CliRunner().invoke(app, [command, "--help"])
    assert r.exit_code == 0, r.output


def test_k8s_multinode_job_keeps_hosts_ranks_and_gpus_consistent(k8s, needed_grace_s):
    path = REPO / "deploy" / "kubernetes" / "job-multinode.yaml"
    docs = {d["kind"]: d for d in yaml.safe_load_all(path.read_text()) if d}
    job, svc = docs["Job"], docs["Service"]
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    assert spec["completionMode"] == "Indexed"
    assert spec["podFailurePolicy"] == k8s["Job"]["spec"]["podFailurePolicy"]
    assert pod["terminationGracePeriodSeconds"] >= needed_grace_s
    (c,) = pod["containers"]
    sets = dict(a.split("=", 1) for a in c["args"] if "=" in a)
    assert int(sets["distributed.nnodes"]) == spec["completions"] == spec["parallelism"]
    assert sets["distributed.node_rank"] == "$(JOB_COMPLETION_INDEX)"
    assert int(sets["distributed.nproc_per_node"]) == c["resources"]["limits"]["nvidia.com/gpu"]
    host, port = sets["distributed.rdzv_endpoint"].rsplit(":", 1)
    assert host == f"{job['metadata']['name']}-0.{svc['metadata']['name']}"
    assert pod["subdomain"] == svc["metadata"]["name"] and svc["spec"]["clusterIP"] == "None"
    assert int(port) == svc["spec"]["ports"][0]["port"]
    env = {e["name"]: e for e in c["env"]}
    assert "JOB_COMPLETION_INDEX" in env and env["NCCL_NVLS_ENABLE"]["value"] == "0"
    runs = next(m for m in c["volumeMounts"] if m["mountPath"] == "/runs")
    assert "$(JOB_COMPLETION_INDEX)" in runs["subPathExpr"]  # one run dir per host
