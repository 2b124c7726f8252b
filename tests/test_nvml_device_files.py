"""NVML down on a node with /dev/nvidiaN files is a broken driver; without them, a CPU-only node.
The count is what keeps the NVML-down alert quiet on CPU nodes (dashboards/gpuwatch-alerts.yml)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from gpuwatch.simulate import fakenvml
from gpuwatch.sources.nvml import count_nvidia_device_files


def test_only_per_gpu_device_files_count(tmp_path: Path) -> None:
    for name in ("nvidia0", "nvidia1", "nvidia7", "nvidiactl", "nvidia-uvm", "nvidia-uvm-tools",
                 "nvidia-modeset", "nvidia-caps", "nvme0", "nvidia0n1"):
        (tmp_path / name).touch()
    assert count_nvidia_device_files(str(tmp_path)) == 3
    assert count_nvidia_device_files(str(tmp_path / "absent")) == 0


def test_a_node_whose_library_is_missing_reports_its_device_files(
        tmp_path: Path, cli_env: dict[str, str]) -> None:
    (tmp_path / "nvidia0").touch()
    (tmp_path / "nvidia1").touch()
    env = {k: v for k, v in cli_env.items()
           if k not in (fakenvml.STATE_ENV, "LD_LIBRARY_PATH")}  # no NVML library at all
    code = ("import json, sys; from gpuwatch.sources.nvml import NvmlSource; "
            "s = NvmlSource(dev_dir=sys.argv[1]).read().status; "
            "print(json.dumps([s.available, s.error, s.device_files]))")
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=60)
    available, error, files = json.loads(done.stdout)
    assert (available, files) == (False, 2), error
