"""The torch-free GPU health gate: an NVML probe child (`probe`), the checks that judge its
readings (`checks`), an NVML fake for tests (`fake_nvml`), and `python -m m3run.runner.health`."""
