"""The MFU denominator's M3RUN_PEAK_FLOPS override: a good value is used, a bad one warns once
with what is used instead."""

from __future__ import annotations

import pytest
import torch

from m3run.runner.worker import telemetry


@pytest.fixture
def h100(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    return torch.device("cuda")


def test_a_good_peak_flops_value_is_used(h100, monkeypatch, capsys):
    monkeypatch.setenv("M3RUN_PEAK_FLOPS", "7.5e14")
    assert telemetry.peak_flops(h100) == 7.5e14
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize("value", ["fast", "-1", "0", "nan", "inf"])
def test_a_bad_peak_flops_value_warns_and_uses_the_nominal_peak(h100, monkeypatch, capsys, value):
    monkeypatch.setenv("M3RUN_PEAK_FLOPS", value)
    assert telemetry.peak_flops(h100) == 989e12
    out = capsys.readouterr().out
    assert out.count("\n") == 1
    assert f"M3RUN_PEAK_FLOPS={value!r}" in out and "nominal bf16 peak" in out
