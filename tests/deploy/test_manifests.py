"""The container and deployment manifests keep the supervisor's contract: grace periods that cover
a checkpoint save, exit-code handling that matches runner/protocol.py, a non-root image with tini
and SIGTERM, health checks and commands the CLI really has, an image a cluster can pull, and the
data paths the A100 recipe reads.

No Docker engine, cluster or systemd instance is needed: the files are parsed and checked. Their
schemas and linters (Kubernetes, compose-spec, SkyPilot, hadolint, systemd) are test_validators.py.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import typer.main
import yaml
from typer.testing import CliRunner

from m3run.runner.cli import app
from m3run.runner.config import load_config
from m3run.runner.protocol import (
    EXIT_CONFIG,
    EXIT_OK,
    EXIT_SOFTWARE,
    EXIT_STOPPED,
    EXIT_UNAVAILABLE,
)

REPO = Path(__file__).resolve().parents[2]
RECIPE = "configs/pretrain_a100_434m.yaml"
RUN_DIR = "/runs/pretrain_a100_434m"
K8S = REPO / "deploy" / "kubernetes"
# The image the cluster recipes pull: a placeholder for the user's registry, never a bare name
# (which a cluster resolves to docker.io/library/...).
IMAGE = "ghcr.io/your-org/m3run:0.1.0"
# The image's extras: checkpoint mirror backends and both metric trackers.
IMAGE_EXTRAS = ("mirror", "wandb", "tensorboard")
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


def parse_cli(argv: list[str]) -> None:
    """argv (after `m3run`) parses as the CLI's command line: the command and its options exist.
    Nothing runs."""
    group = typer.main.get_command(app)
    command = group.commands[argv[0]]
    command.make_context(argv[0], list(argv[1:]))


@pytest.fixture(scope="module")
def recipe_source_dirs() -> set[str]:
    """The prepared-data folders the A100 recipe reads (each holds train/ and val/)."""
    cfg = load_config(REPO / RECIPE)
    dirs = {str(Path(s.path).parent) for s in cfg.data.sources}
    assert str(Path(cfg.data.val_path).parent) in dirs
    return dirs


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


def test_image_runs_as_a_numeric_non_root_user():
    # Numeric, so that a cluster's runAsNonRoot can check it without reading /etc/passwd.
    users = instruction("USER")
    assert users, "the Dockerfile never switches away from root"
    uid, gid = re.fullmatch(r"(\d+):(\d+)", users[-1]).groups()
    assert int(uid) != 0 and int(gid) != 0
    runs = " ".join(instruction("RUN"))
    assert re.search(rf"useradd --uid {uid} --gid {gid}\b", runs)
    assert re.search(rf"groupadd --gid {gid}\b", runs)


def test_image_runs_its_shell_lines_with_pipefail():
    (shell,) = instruction("SHELL")
    argv = exec_form(shell)
    assert Path(argv[0]).name == "bash" and argv[1:3] == ["-o", "pipefail"] and argv[-1] == "-c"


def test_base_image_is_pinned_by_digest_with_its_tag_beside_it():
    (arg,) = [a for a in instruction("ARG") if a.startswith("BASE_IMAGE=")]
    assert re.fullmatch(r"BASE_IMAGE=[\w./-]+@sha256:[0-9a-f]{64}", arg), arg
    assert instruction("FROM") == ["${BASE_IMAGE}"]
    repo = arg.split("=", 1)[1].split("@")[0]
    text = (REPO / "Dockerfile").read_text()
    comments = text[: text.index("ARG BASE_IMAGE=")]
    assert re.search(rf"^#\s+{re.escape(repo)}:[\w.-]+\s*$", comments, re.M), "no tag comment"


def test_image_installs_dependencies_before_the_code():
    """A code change must not reinstall every dependency: the layer that installs them is built
    from pyproject.toml (and the helper that reads it) alone, and `COPY .` comes after it."""
    steps = dockerfile()
    copies = [i for i, (w, _) in enumerate(steps) if w == "COPY"]
    (code,) = [i for i in copies if steps[i][1].split()[0] == "."]
    (deps,) = [i for i in copies if i != code]
    assert steps[deps][1].split()[:-1] == ["pyproject.toml", "docker/project_requirements.py"]
    pip = [i for i, (w, a) in enumerate(steps) if w == "RUN" and "pip install" in a]
    assert len(pip) == 2 and deps < pip[0] < code < pip[1]
    assert "--requirement" in steps[pip[0]][1]
    assert f"project_requirements.py /tmp/m3run-deps/pyproject.toml {' '.join(IMAGE_EXTRAS)}" in (
        re.sub(r"\s+", " ", steps[pip[0]][1])
    )
    assert f"[{','.join(IMAGE_EXTRAS)}]" in steps[pip[1]][1]


def test_image_keeps_the_base_torch():
    pip = [r for r in instruction("RUN") if "pip install" in r]
    assert pip
    for run in pip:
        # pinned to the base image's build, so pip can only keep it, never replace it
        assert "--constraint /tmp/keep-torch.txt" in run
        assert not re.search(r"pip install[^&]*\btorch\b(?!\.)", run.replace("keep-torch", ""))
    # The pin is the installed distribution's version as pip sees it (its metadata), never
    # torch.__version__, whose local tag (+cu130) a torch installed from PyPI does not carry.
    pin = re.search(r'python -c "([^"]*)" > /tmp/keep-torch.txt', pip[0])
    assert pin and "importlib.metadata" in pin.group(1) and "version('torch')" in pin.group(1)
    assert "torch.__version__" not in pin.group(1)
    out = subprocess.run(
        [sys.executable, "-c", pin.group(1)], capture_output=True, text=True, timeout=60
    )
    assert out.stdout.strip() == f"torch=={importlib.metadata.version('torch')}", out.stderr


def test_base_image_reference_is_fully_qualified():
    """podman and buildah refuse a short name (`pytorch/pytorch@…`): the default names its
    registry."""
    (arg,) = [a for a in instruction("ARG") if a.startswith("BASE_IMAGE=")]
    first = arg.split("=", 1)[1].split("/")[0]
    assert "." in first or ":" in first or first == "localhost", arg


def test_a_cpu_base_is_refused_unless_the_build_allows_it():
    """REQUIRE_CUDA (default true) checks torch's CUDA build and Triton before anything is
    installed; false, for the CPU image test, accepts a CPU torch; any other value fails."""
    assert "REQUIRE_CUDA=true" in instruction("ARG")
    (check,) = [r for r in instruction("RUN") if "REQUIRE_CUDA" in r]
    case = check[: check.index("esac") + len("esac")]

    def run(value: str) -> subprocess.CompletedProcess:
        env = {**os.environ, "REQUIRE_CUDA": value, "PATH": _venv_path()}
        return subprocess.run(
            ["bash", "-o", "pipefail", "-c", case], env=env, capture_output=True, text=True
        )

    assert run("false").returncode == 0
    wrong = run("yes")
    assert wrong.returncode != 0 and "REQUIRE_CUDA must be true or false, got 'yes'" in wrong.stderr
    cuda = subprocess.run(
        [sys.executable, "-c", "import torch, triton; assert torch.version.cuda"],
        capture_output=True,
    )
    default = run("true")
    if cuda.returncode == 0:
        assert default.returncode == 0, default.stderr
    else:  # this machine's torch is a CPU build (or has no Triton): refused, naming why
        assert default.returncode != 0
        assert "not a CUDA build" in default.stderr or "triton" in default.stderr, default.stderr


def _venv_path() -> str:
    """PATH with this interpreter's folder first, so the Dockerfile's `python` is it."""
    return os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])


def project_requirements(*extras: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            str(REPO / "docker" / "project_requirements.py"),
            "pyproject.toml",
            *extras,
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_the_dependency_layer_lists_the_projects_requirements():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    r = project_requirements("mirror")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines == project["dependencies"] + project["optional-dependencies"]["mirror"]
    missing = project_requirements("mirror", "no-such-extra")
    assert missing.returncode != 0 and "no-such-extra" in missing.stderr  # the build fails


def test_the_images_extras_exist():
    defined = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    missing = [e for e in IMAGE_EXTRAS if e not in defined["optional-dependencies"]]
    assert not missing, f"the image installs extras pyproject.toml does not define: {missing}"
    assert project_requirements(*IMAGE_EXTRAS).returncode == 0


def test_image_installs_its_scripts_and_keeps_caches_on_the_volumes():
    runs = " ".join(instruction("RUN"))
    assert "docker/prepare-a100-data /usr/local/bin/m3run-prepare-a100-data" in runs
    env = " ".join(instruction("ENV"))
    for name, where in (
        ("TRITON_CACHE_DIR", "/runs/"),
        ("TORCHINDUCTOR_CACHE_DIR", "/runs/"),
        ("XDG_CACHE_HOME", "/runs/"),  # the token-shard check record: no rehash after a restart
    ):
        assert re.search(rf"\b{name}={re.escape(where)}\S+", env), name


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


def test_compose_prepare_is_a_profile_that_prepares_the_recipes_data(compose):
    prepare = compose["services"]["prepare"]
    assert prepare["profiles"] == ["prepare"]
    assert prepare["restart"] == "no"
    # the image's script, which prepares what the recipe reads (test_prepare_script.py), under tini
    assert prepare["entrypoint"] == [
        "/usr/bin/tini",
        "--",
        "/usr/local/bin/m3run-prepare-a100-data",
    ]
    assert "command" not in prepare  # setting the entrypoint drops the image's launch CMD
    # the image's HEALTHCHECK watches a training run's heartbeat: off for a preparing container
    assert prepare["healthcheck"] == {"disable": True}
    assert "deploy" not in prepare  # CPU only
    assert {v["target"] for v in prepare["volumes"]} >= {"/data"}


# --------------------------------------------------------------------------- Kubernetes


def k8s_docs(name: str) -> dict[str, dict]:
    return {d["kind"]: d for d in yaml.safe_load_all((K8S / name).read_text()) if d}


@pytest.fixture(scope="module")
def k8s() -> dict[str, dict]:
    return k8s_docs("job.yaml")


def pod_specs() -> list[tuple[str, dict]]:
    return [
        (path.name, doc["spec"]["template"]["spec"])
        for path in sorted(K8S.glob("*.yaml"))
        for doc in yaml.safe_load_all(path.read_text())
        if doc and doc["kind"] == "Job"
    ]


@pytest.mark.parametrize(("name", "pod"), pod_specs(), ids=[n for n, _ in pod_specs()])
def test_k8s_pods_pull_the_pushed_image_and_own_their_volumes_cheaply(name, pod):
    for c in pod["containers"]:
        assert c["image"] == IMAGE, f"{name}: {c['image']}"
        assert c["imagePullPolicy"] == "IfNotPresent"
    registry, _, rest = IMAGE.partition("/")
    assert "." in registry and rest and not IMAGE.endswith(":latest")  # not docker.io/library
    ctx = pod["securityContext"]
    assert ctx["runAsNonRoot"] is True and ctx["runAsUser"] == ctx["fsGroup"] == 1000
    assert ctx["fsGroupChangePolicy"] == "OnRootMismatch"
    assert pod["restartPolicy"] == "Never"  # podFailurePolicy requires it


def test_k8s_headers_say_the_image_must_be_pushed_and_the_right_versions():
    for name in ("job.yaml", "data.yaml"):
        header = (K8S / name).read_text().split("\napiVersion:")[0]
        assert f"docker push {IMAGE}" in header or "pushed" in header, name
    header = (K8S / "job.yaml").read_text().split("\napiVersion:")[0]
    assert "Kubernetes >= 1.31" in header
    assert "GA in 1.34" in header  # podReplacementPolicy (on by default since 1.29)
    assert "docker push" in header


def header_status_commands(path: Path) -> list[list[str]]:
    """The `m3run status ...` commands in a manifest's comments, as argv after `m3run`."""
    out = []
    for line in path.read_text().splitlines():
        m = re.search(r"--\s+m3run (status\b.*)$", line) if line.startswith("#") else None
        if m:
            out.append(shlex.split(m.group(1)))
    return out


@pytest.mark.parametrize("name", ["job.yaml", "job-multinode.yaml"])
def test_k8s_header_status_command_names_the_run_dir_inside_the_pod(name):
    (job,) = [d for d in yaml.safe_load_all((K8S / name).read_text()) if d and d["kind"] == "Job"]
    (c,) = job["spec"]["template"]["spec"]["containers"]
    run_dir = c["args"][c["args"].index("--run-dir") + 1]
    commands = header_status_commands(K8S / name)
    assert commands, f"{name} shows no `m3run status` in its header"
    for argv in commands:
        parse_cli(argv)
        # no argument: ./runs in the image's working directory is /runs
        assert argv[1:] in ([], [run_dir]), argv


def test_k8s_data_volume_is_prepared_with_what_the_recipe_reads(k8s):
    data = k8s_docs("data.yaml")
    claim = data["PersistentVolumeClaim"]["metadata"]["name"]
    for name in ("job.yaml", "job-multinode.yaml"):
        pod = k8s_docs(name)["Job"]["spec"]["template"]["spec"]
        (c,) = pod["containers"]
        mount = next(m for m in c["volumeMounts"] if m["mountPath"] == "/data")
        volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
        assert volume["persistentVolumeClaim"]["claimName"] == claim, name
        assert mount["readOnly"] is True  # the training pods only read the shards
    job = data["Job"]["spec"]
    pod = job["template"]["spec"]
    (c,) = pod["containers"]
    assert c["command"][:2] == ["/usr/bin/tini", "--"]
    assert re.search(r"^\s*exec m3run-prepare-a100-data\s*$", c["args"][-1], re.M)
    mount = next(m for m in c["volumeMounts"] if m["mountPath"] == "/data")
    assert not mount.get("readOnly")
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    assert volume["persistentVolumeClaim"]["claimName"] == claim
    # bad input (78) is a verdict: a retry reads the same files
    rules = job["podFailurePolicy"]["rules"]
    fail = [r["onExitCodes"]["values"] for r in rules if r["action"] == "FailJob"]
    assert fail == [[EXIT_CONFIG]]
    assert all(r["onExitCodes"]["containerName"] == c["name"] for r in rules if "onExitCodes" in r)


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
    assert res["image_id"] == f"docker:{IMAGE}"


def test_skypilot_mounts_every_source_the_recipe_reads(recipe_source_dirs):
    task = yaml.safe_load((REPO / "deploy" / "skypilot" / "pretrain-spot.yaml").read_text())
    mounts = list(task["file_mounts"])
    for d in recipe_source_dirs:
        assert any(d == m or d.startswith(m.rstrip("/") + "/") for m in mounts), d


# --------------------------------------------------------------------------- systemd


def parse_unit(text: str) -> dict[str, dict[str, list[str]]]:
    """A unit file as {section: {key: [values, in order]}}: systemd keys repeat (Environment=)."""
    out: dict[str, dict[str, list[str]]] = {}
    section = None
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = out.setdefault(line.strip("[]"), {})
            continue
        key, _, value = line.partition("=")
        section.setdefault(key.strip(), []).append(value.strip())
    return out


@pytest.fixture(scope="module")
def unit() -> dict[str, dict[str, str]]:
    parsed = parse_unit((REPO / "deploy" / "systemd" / "m3run.service").read_text())
    return {name: {k: v[-1] for k, v in keys.items()} for name, keys in parsed.items()}


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


def test_systemd_unit_gives_the_home_less_user_its_caches():
    service = parse_unit((REPO / "deploy" / "systemd" / "m3run.service").read_text())["Service"]
    (cache,) = service["CacheDirectory"]
    root = f"/var/cache/{cache}"  # created by systemd, owned by User=
    env = dict(e.split("=", 1) for line in service["Environment"] for e in shlex.split(line))
    for name in ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "XDG_CACHE_HOME"):
        assert env[name] == root or env[name].startswith(root + "/"), name


def test_systemd_walkthrough_is_a_production_install_that_prepares_the_data(recipe_source_dirs):
    text = (REPO / "deploy" / "systemd" / "README.md").read_text()
    block = re.search(r"```\n(.*?)```", text, re.S).group(1)
    assert "make install" not in block and "[dev" not in block  # no test tools in production
    assert re.search(r"pip install '\.\[[\w,]*mirror[\w,]*\]'", block)
    # the recipe's /data/<source> folders are where the walk-through prepares them
    assert re.search(r"ln -sfn \S+ /data\b", block)
    outs = set(re.findall(r"m3run prepare-data .*--out (\S+)", block))
    assert outs == recipe_source_dirs
    for line in re.findall(r"\.venv/bin/m3run (.+)", block):
        parse_cli(shlex.split(line))


# --------------------------------------------------------------------------- the CLI they call


def commands_used() -> set[str]:
    """Every `m3run <command>` the manifests run."""
    used = {exec_form(instruction("CMD")[-1])[0]}
    compose = yaml.safe_load((REPO / "compose.yaml").read_text())
    used |= {s["command"][0] for s in compose["services"].values() if "command" in s}
    used |= {
        s["healthcheck"]["test"][2]
        for s in compose["services"].values()
        if "test" in s.get("healthcheck", {})
    }
    for _, pod in pod_specs():
        for c in pod["containers"]:
            if "command" not in c:  # through the image's entrypoint: `m3run <args>`
                used.add(c["args"][0])
            if "livenessProbe" in c:
                used.add(c["livenessProbe"]["exec"]["command"][1])
    return used


def recipe_header_commands(path: Path) -> list[list[str]]:
    """The `m3run ...` command lines quoted in a recipe's comments, as argv after `m3run`; a
    quoted `--set ...` is added to the launch before it."""
    quoted = [
        q
        for line in path.read_text().splitlines()
        if line.startswith("#")
        for q in re.findall(r"`([^`]+)`", line)
    ]
    out: list[list[str]] = []
    for q in quoted:
        argv = shlex.split(q.replace("<run>", "run1"))
        if argv[0] == "m3run":
            out.append(argv[1:])
        elif argv[0] == "--set" and out:
            out.append(out[-1] + argv)
    return out


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_recipe_headers_show_commands_the_cli_has(path):
    for argv in recipe_header_commands(path):
        parse_cli(argv)
        if argv[0] == "launch":
            sets = [argv[i + 1] for i, a in enumerate(argv) if a == "--set"]
            load_config(REPO / argv[1], sets)


def test_the_cli_parse_check_rejects_an_option_that_does_not_exist():
    with pytest.raises(Exception, match="--config"):
        parse_cli(["launch", "--config", RECIPE])


def test_liveness_check_is_a_real_cli_option():
    r = CliRunner().invoke(app, ["health", "--help"])
    assert r.exit_code == 0, r.output
    assert "--liveness" in r.output


@pytest.mark.parametrize("command", sorted(commands_used()))
def test_every_command_the_manifests_run_exists(command):
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
