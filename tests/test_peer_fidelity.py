"""gpuwatch sees what gpustat and nvitop, unmodified, see of the same node.

Both peers round what they print (tests/peers.py documents how); gpuwatch's exact bytes, rounded
the peer's way, must equal what the peer printed: same devices, same PIDs, same memory.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from gpuwatch.simulate.fakenvml import FakeNode
from tests import peers
from tests.realprocs import GIB, MIB, running_job, status_json


def test_status_json_matches_gpustat_and_nvitop_on_the_same_node(
        fake_node: FakeNode, cli_env: dict[str, str], tmp_path: Path) -> None:
    fake_node.devices[0].reserved = 542 * MIB
    fake_node.devices[1].unattributed = 300 * MIB
    fake_node.write()
    loner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        with running_job(tmp_path, workers=2) as job:
            w0, w1 = job.workers
            held = {(0, w0): 1536 * MIB + 12345, (1, w1): 21 * GIB + 1234567,
                    (1, w0): 700 * MIB + 3, (0, loner.pid): 5 * GIB}
            for (gpu, pid), used in held.items():
                fake_node.hold(pid, gpu, used)
            code, doc = status_json(cli_env)
            gpustat = peers.gpustat_view(cli_env)
            nvitop = peers.nvitop_view(cli_env)
    finally:
        loner.kill()
        loner.wait()

    assert code == 0
    ours_gpus = doc["gpus"]
    ours_procs = {(u["index"], p["pid"]): u["memory_bytes"]
                  for p in doc["processes"] for u in p["gpus"]}
    assert ours_procs == held  # gpuwatch itself is exact

    for view, shown in ((gpustat, peers.gpustat_shown), (nvitop, peers.nvitop_shown)):
        tool = view["tool"]
        assert [g["index"] for g in view["gpus"]] == [g["index"] for g in ours_gpus], tool
        for theirs, ours in zip(view["gpus"], ours_gpus):
            assert theirs["memory_total_bytes"] == shown(ours["memory_total_bytes"]), tool
            assert theirs["memory_used_bytes"] == shown(ours["memory_used_bytes"]), tool
        assert view["processes"] == {k: shown(v) for k, v in ours_procs.items()}, tool

    assert [g["uuid"] for g in gpustat["gpus"]] == [g["uuid"] for g in ours_gpus]
    assert [g["name"] for g in gpustat["gpus"]] == [g["name"] for g in ours_gpus]
    assert [g["name"] for g in nvitop["gpus"]] == [
        peers.nvitop_shown_name(g["name"]) for g in ours_gpus]
