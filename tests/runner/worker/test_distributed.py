"""The worker under torchrun with gloo on CPU: two processes reproduce the single-process loss
curve at the same global batch."""

from __future__ import annotations

import subprocess
import sys

import pytest
from helpers.runs import DEMO_CONFIG, tiny_run_overrides, worker_env
from helpers.training import run_worker, train_losses

pytestmark = pytest.mark.slow


def torchrun_worker(run_dir, overrides, nproc=2, env=None, timeout=300):
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(nproc),
        "--max-restarts",
        "0",
        "-m",
        "m3run.runner.train",
        str(DEMO_CONFIG),
        "--run-dir",
        str(run_dir),
    ]
    for o in overrides:
        cmd += ["--set", o]
    return subprocess.run(
        cmd, env=env or worker_env(), capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture(scope="module")
def one(corpus, tmp_path_factory):
    """The single-process run of the global batch both multi-process tests reproduce (10 steps
    of 4 sequences × 2 accumulation), trained once per module: a worker costs seconds of CPU."""
    run_dir = tmp_path_factory.mktemp("one") / "run"
    ov = tiny_run_overrides(corpus, **{"train.total_steps": 10, "train.grad_accum_steps": 2})
    done = run_worker(run_dir, ov)
    assert done.returncode == 0, done.stderr
    return run_dir, ov


def test_two_processes_reproduce_the_single_process_curve(one, tmp_path):
    one_dir, ov = one
    two = torchrun_worker(tmp_path / "two", ov)
    assert two.returncode == 0, two.stdout + two.stderr
    assert "global batch 8 sequences = 4 × 1 accumulation × 2 processes" in two.stdout
    a, b = train_losses(one_dir), train_losses(tmp_path / "two")
    assert sorted(a) == sorted(b) == list(range(1, 11))
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=1e-5, abs=1e-6), step
    assert (tmp_path / "two" / "heartbeat.local1.json").exists()


def test_world_size_that_cannot_keep_the_global_batch_is_a_config_error(corpus, tmp_path):
    ov = tiny_run_overrides(corpus, **{"train.total_steps": 2, "train.grad_accum_steps": 3})
    r = torchrun_worker(tmp_path / "run", ov)
    assert r.returncode != 0
    assert "grad_accum_steps=3" in r.stdout + r.stderr


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_supervisors_form_a_two_node_job_through_c10d(one, tmp_path):
    """Two hosts simulated on 127.0.0.1: each has its own supervisor and run dir, node 0 hosts
    the rendezvous; both train the same steps and both hold the final checkpoint."""
    from m3run.runner.checkpoint.layout import latest_complete

    one_dir, ov = one
    endpoint = f"127.0.0.1:{_free_port()}"
    procs = []
    for rank in (0, 1):
        cmd = [
            sys.executable,
            "-m",
            "m3run.runner.cli",
            "launch",
            str(DEMO_CONFIG),
            "--run-dir",
            str(tmp_path / f"node{rank}"),
        ]
        for o in [
            *ov,
            "distributed.nnodes=2",
            f"distributed.node_rank={rank}",
            f"distributed.rdzv_endpoint={endpoint}",
            "distributed.rdzv_id=job1",
            "supervisor.smoke=false",
            "distributed.timeout_s=60",
        ]:
            cmd += ["--set", o]
        env = worker_env()
        procs.append(
            subprocess.Popen(
                cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
        )
    outs = [p.communicate(timeout=300)[0] for p in procs]
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode == 0, out[-3000:]
    ref = train_losses(one_dir)
    for rank in (0, 1):
        run_dir = tmp_path / f"node{rank}"
        assert latest_complete(run_dir).step == 10
        losses = train_losses(run_dir)
        assert sorted(losses) == list(range(1, 11))
        for step, loss in ref.items():
            assert losses[step] == pytest.approx(loss, rel=1e-5, abs=1e-6), (rank, step)
