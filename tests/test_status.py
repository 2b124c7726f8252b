"""`gpuwatch status` on real process trees under the fake NVML driver, and how the document and
the table view show what a leak finding carries."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from types import MappingProxyType

import pytest

from gpuwatch.cli import EXIT_NVML_UNAVAILABLE, EXIT_OK, EXIT_PARTIAL
from gpuwatch.frozen import evolve
from gpuwatch.model import Kind, NodeReport
from gpuwatch.simulate import fakenvml
from gpuwatch.simulate.fakenvml import FakeNode
from gpuwatch.sinks.document import (
    DOCUMENT_CUT,
    MAX_DOCUMENT_BYTES,
    bounded_json,
    from_json,
    status_document,
)
from gpuwatch.sinks.status_view import render_status
from gpuwatch.units import short_command
from tests import leakreports
from tests.realprocs import (
    GIB,
    MIB,
    gpuwatch,
    processes_by_pid,
    real_nvml_present,
    running_job,
    status_json,
)


def test_launcher_and_two_workers_show_as_one_tree_with_memory_per_gpu_and_the_job(
        fake_node: FakeNode, cli_env: dict[str, str], tmp_path: Path) -> None:
    with running_job(tmp_path, workers=2, env={"SLURM_JOB_ID": "4242"}) as job:
        w0, w1 = job.workers
        fake_node.hold(w0, device=0, used=3 * GIB)
        fake_node.hold(w1, device=1, used=5 * GIB)

        code, doc = status_json(cli_env)
        assert code == EXIT_OK
        assert doc["schema"] == 1 and doc["source"] == "poll" and doc["findings"] == []
        procs = processes_by_pid(doc)
        for pid, gpu, used in ((w0, 0, 3 * GIB), (w1, 1, 5 * GIB)):
            p = procs[pid]
            assert p["ppid"] == job.launcher_pid
            assert [(u["index"], u["memory_bytes"]) for u in p["gpus"]] == [(gpu, used)]
            assert p["gpus"][0]["uuid"] == fake_node.devices[gpu].uuid
            assert p["gpu_memory_bytes"] == used
            assert p["job"] == {"id": "4242", "source": "slurm"}
            assert p["launch_env"]["LOCAL_RANK"] in ("0", "1")
            assert p["rss_bytes"] > 0 and p["user"] and p["start_time"] > 0
        launcher = procs[job.launcher_pid]
        assert not launcher["holds_gpu"] and launcher["job"] == {"id": "4242", "source": "slurm"}
        assert 1 in procs  # ancestors are followed up to PID 1
        by_index = {g["index"]: g for g in doc["gpus"]}
        assert by_index[0]["memory_used_bytes"] == 3 * GIB
        assert by_index[1]["memory_used_bytes"] == 5 * GIB
        assert by_index[0]["unattributed_memory_bytes"] == 0

        table = gpuwatch(["status"], cli_env)
        assert table.returncode == EXIT_OK, table.stderr
        lines = table.stdout.splitlines()
        root = _line_of(lines, str(job.launcher_pid))
        first = _line_of(lines, f"├─ {w0}")
        last = _line_of(lines, f"└─ {w1}")
        assert root < first < last
        assert "0:3.0 GiB" in lines[first] and "1:5.0 GiB" in lines[last]
        assert "slurm:4242" in lines[first]
        assert "one poll" in lines[0]


def test_without_any_nvml_library_status_says_so_and_still_shows_worker_processes(
        tmp_path: Path, cli_env: dict[str, str]) -> None:
    if real_nvml_present():
        pytest.skip("this machine has a real libnvidia-ml.so.1")
    env = {k: v for k, v in cli_env.items() if k not in ("LD_LIBRARY_PATH", fakenvml.STATE_ENV)}
    with running_job(tmp_path, workers=1) as job:
        result = gpuwatch(["status"], env)
        assert result.returncode == EXIT_NVML_UNAVAILABLE
        assert "NVML unavailable: NVML Shared Library Not Found" in result.stdout
        assert str(job.workers[0]) in result.stdout  # its LOCAL_RANK marks it a worker
        code, doc = status_json(env)
        assert code == EXIT_NVML_UNAVAILABLE
        assert doc["nvml"]["available"] is False and doc["gpus"] == []
        assert job.workers[0] in processes_by_pid(doc)


def test_a_library_whose_init_fails_gives_the_reason_and_the_host_view(
        fake_node: FakeNode, cli_env: dict[str, str], tmp_path: Path) -> None:
    fake_node.fail("nvmlInitWithFlags", fakenvml.DRIVER_NOT_LOADED)
    with running_job(tmp_path, workers=1) as job:
        code, doc = status_json(cli_env)
        assert code == EXIT_NVML_UNAVAILABLE
        assert doc["nvml"]["error"] == "Driver Not Loaded"
        assert doc["nvml"]["error_code"] == fakenvml.DRIVER_NOT_LOADED
        assert job.workers[0] in processes_by_pid(doc)


def test_a_lost_gpu_is_marked_while_the_other_is_still_read(
        fake_node: FakeNode, cli_env: dict[str, str], tmp_path: Path) -> None:
    with running_job(tmp_path, workers=2) as job:
        fake_node.hold(job.workers[0], device=0, used=2 * GIB)
        fake_node.hold(job.workers[1], device=1, used=2 * GIB)
        fake_node.fail("*", fakenvml.GPU_IS_LOST, device=1)
        code, doc = status_json(cli_env)
        assert code == EXIT_PARTIAL
        gpu0, gpu1 = doc["gpus"]
        assert gpu0["errors"] == [] and gpu0["memory_used_bytes"] == 2 * GIB
        assert gpu1["lost"] is True and gpu1["errors"]
        assert all(e["message"] == "GPU is lost" for e in gpu1["errors"])
        procs = processes_by_pid(doc)
        assert procs[job.workers[0]]["gpu_memory_bytes"] == 2 * GIB
        assert job.workers[1] not in procs or not procs[job.workers[1]]["holds_gpu"]
        table = gpuwatch(["status"], cli_env)
        assert "LOST (needs a reset)" in table.stdout


def test_a_failing_process_list_call_is_reported_and_the_rest_of_the_device_kept(
        fake_node: FakeNode, cli_env: dict[str, str], tmp_path: Path) -> None:
    with running_job(tmp_path, workers=1) as job:
        fake_node.hold(job.workers[0], device=0, used=GIB)
        fake_node.fail("nvmlDeviceGetComputeRunningProcesses_v3", fakenvml.TIMEOUT, device=0)
        code, doc = status_json(cli_env)
        assert code == EXIT_PARTIAL
        gpu0 = doc["gpus"][0]
        assert gpu0["memory_total_bytes"] > 0 and gpu0["memory_used_bytes"] == GIB
        assert [e["call"] for e in gpu0["errors"]] == ["nvmlDeviceGetComputeRunningProcesses"]
        assert gpu0["errors"][0]["message"] == "Timeout"
        assert doc["gpus"][1]["errors"] == []


def test_memory_not_available_for_a_pid_is_unknown_not_zero(
        fake_node: FakeNode, cli_env: dict[str, str], tmp_path: Path) -> None:
    with running_job(tmp_path, workers=2) as job:
        fake_node.hold(job.workers[0], device=0, used=None)
        fake_node.hold(job.workers[1], device=0, used=GIB)
        code, doc = status_json(cli_env)
        assert code == EXIT_OK
        procs = processes_by_pid(doc)
        assert procs[job.workers[0]]["gpus"][0]["memory_bytes"] is None
        assert procs[job.workers[0]]["gpu_memory_bytes"] is None
        assert procs[job.workers[1]]["gpu_memory_bytes"] == GIB
        assert doc["gpus"][0]["unattributed_memory_bytes"] is None
        table = gpuwatch(["status"], cli_env)
        assert "0:?" in table.stdout


def test_a_pid_nvml_lists_but_proc_lacks_is_kept_and_marked(
        fake_node: FakeNode, cli_env: dict[str, str]) -> None:
    ghost = _unused_pid()
    fake_node.hold(ghost, device=1, used=3 * GIB, ghost=True)
    code, doc = status_json(cli_env)
    assert code == EXIT_OK
    p = processes_by_pid(doc)[ghost]
    assert p["in_procfs"] is False and p["gpu_memory_bytes"] == 3 * GIB
    assert p["name"] is None and p["ppid"] is None
    table = gpuwatch(["status"], cli_env)
    assert "not in /proc" in table.stdout


def test_eight_gpus_with_sixty_four_real_processes_poll_without_error(
        tmp_path: Path, fake_nvml_lib: Path, cli_env: dict[str, str]) -> None:
    node = FakeNode(tmp_path / "state8", fake_nvml_lib, gpus=8)
    holders = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
               for _ in range(64)]
    try:
        for i, p in enumerate(holders):
            node.processes.append(fakenvml.FakeProcess(device=i % 8, pid=p.pid,
                                                       used=GIB + i * MIB))
        node.write()
        env = {**cli_env, **node.env(cli_env)}
        code, doc = status_json(env)
        assert code == EXIT_OK and doc["errors"] == []
        assert len(doc["gpus"]) == 8
        holding = {p["pid"]: p for p in doc["processes"] if p["holds_gpu"]}
        assert set(holding) == {p.pid for p in holders}
        assert all(holding[p.pid]["gpu_memory_bytes"] == GIB + i * MIB
                   for i, p in enumerate(holders))
    finally:
        for p in holders:
            p.kill()
            p.wait()


def _line_of(lines: list[str], needle: str) -> int:
    matches = [i for i, line in enumerate(lines) if needle in line]
    assert matches, f"{needle!r} not in:\n" + "\n".join(lines)
    return matches[0]


def _unused_pid() -> int:
    with open("/proc/sys/kernel/pid_max") as f:
        pid_max = int(f.read())
    for pid in range(pid_max - 1, 1, -1):
        if not Path(f"/proc/{pid}").exists():
            return pid
    raise AssertionError("no free PID")


def test_a_command_reads_by_program_name_and_a_script_by_its_own_name() -> None:
    """The table's COMMAND and the reasons: a long interpreter path never pushes the arguments
    that tell processes apart out of the row, and a script run through its #! line is shown as
    the kernel names the process."""
    assert short_command("torchrun", ["/opt/conda/envs/train/bin/python3.11",
                                      "/opt/conda/envs/train/bin/torchrun", "--nproc-per-node",
                                      "8", "train.py"]) == "torchrun --nproc-per-node 8 train.py"
    # The kernel keeps 15 bytes of a name.
    assert short_command("pretrain_launch", ["/usr/bin/python3", "/srv/pretrain_launcher.py",
                                             "-c", "x.yaml"]) == "pretrain_launcher.py -c x.yaml"
    assert short_command("python3", ["/usr/bin/python3", "-u", "train.py"]) == \
        "python3 -u train.py"
    assert short_command("python", ["python", "-m", "torch.distributed.run"]) == \
        "python -m torch.distributed.run"
    assert short_command("kworker/0:1", []) == "[kworker/0:1]"


def _leak_lines(text: str, pid: int) -> list[str]:
    """The leak's row and the notes under it."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("leak ")
                 and line.split()[2] == str(pid))
    end = start + 1
    while end < len(lines) and lines[end].startswith(" "):
        end += 1
    return lines[start:end]


def test_a_leak_shows_its_culprit_how_it_was_found_and_the_culprits_own_growth() -> None:
    doc = status_document(leakreports.leak_report())
    text = render_status(from_json(doc), width=0)
    row, note = _leak_lines(text, 701)
    assert "(discovered)" in row and row.endswith("[+2.0 GiB/step]")
    # The note sits under the reason.
    assert note.index("culprit") == row.index("RSS grows")
    assert note.strip() == ("culprit `areal.infra.rpc.rtensor._fetch_buffer` (discovered): "
                            "+16 items/step, ~2.0 GiB/step")
    # A narrow terminal wraps the reason under itself, and the culprit's line too: no line
    # is wider than the terminal (which would break it at column 0), no character is cut.
    narrow = _leak_lines(render_status(from_json(doc), width=80), 701)
    assert all(len(line) <= 80 for line in narrow)
    culprit = next(i for i, line in enumerate(narrow) if line.strip().startswith("culprit"))
    assert {line.index(line.strip()) for line in narrow[1:]} == {narrow[0].index("RSS grows")}
    assert "".join("".join(line.split()) for line in narrow[culprit:]) == "".join(note.split())
    assert " ".join(line.strip() for line in narrow[:culprit]).endswith(
        "it (discovered) [+2.0 GiB/step]")
    row, note = _leak_lines(text, 700)
    assert note.strip() == "culprit `fetch_buffer` (watched): +1 items/step, ~2.0 MiB/step"
    assert "items/step" not in row  # the culprit's figures are on its own line, once
    row, note, traced = _leak_lines(text, 702)
    assert note.strip() == "culprit `leaky.py:42` (traced): ~3.0 MiB/step"
    assert traced.strip() == "traced 20 steps; `gpuwatch status -v` shows where it allocates"
    assert "train.py:120" not in text  # the traceback is for the verbose view
    # A culprit is never cut: a long file path ends in the line number that matters.
    (_, note) = _leak_lines(text, 704)
    assert note.strip().startswith(f"culprit `{leakreports.LONG_SITE}` (traced)")
    # Nothing explains it: the leak alone, no culprit line.
    assert len(_leak_lines(text, 705)) == 1


def test_a_trace_asked_for_refused_or_failed_is_said_in_a_few_words() -> None:
    def notes(trace: dict[str, object]) -> list[str]:
        finding = leakreports.leak(800, "RSS grows every step", growth_bytes_per_step=MIB,
                                   culprit=None, found_by=None, trace=trace)
        text = render_status(from_json(status_document(leakreports.leak_report((finding,)))))
        return [line.strip() for line in _leak_lines(text, 800)[1:]]

    assert notes({"status": "requested", "why": "", "steps": 20}) == ["tracing requested"]
    assert notes({"status": "refused", "why": "GPUWATCH_AGENT_TRACING=0"}) == [
        "tracing refused by the process: GPUWATCH_AGENT_TRACING=0"]
    assert notes({"status": "failed", "why": "tracemalloc could not start"}) == [
        "tracing failed: tracemalloc could not start"]
    # Traced, but no site explains the growth: the largest is named all the same.
    assert notes({"status": "done", "why": "", "steps": 20,
                  "sites": [{"site": "cache.py:7", "bytes_per_step": 2048,
                             "count_per_step": 1.0}], "traceback": []}) == [
        "traced 20 steps: no allocation site explains it (largest: `cache.py:7`, "
        "~2.0 KiB/step)"]


def test_the_verbose_view_lists_the_traced_sites_and_the_largest_ones_traceback() -> None:
    doc = status_document(leakreports.leak_report())
    lines = [line.strip() for line in _leak_lines(render_status(from_json(doc), verbose=True), 702)]
    assert lines[1:] == [
        "culprit `leaky.py:42` (traced): ~3.0 MiB/step",
        "traced 20 steps",
        "allocation sites, largest first:",
        "`leaky.py:42`  ~3.0 MiB/step, +1 blocks/step",
        "`data/loader.py:88`  ~4.0 KiB/step, +0.5 blocks/step",
        "traceback of `leaky.py:42`, oldest call first:",
        "train.py:120",
        "model/step.py:57",
        "leaky.py:42",
    ]


def test_a_leak_from_before_culprits_were_found_other_ways_reads_as_it_did() -> None:
    """Details without `found_by` (a daemon before it): the culprit is named all the same,
    and a buffer that grows alone keeps its figures in the row, not on a line of its own."""
    older = leakreports.leak(900, "RSS grows every step; buffer `replay` explains it",
                             growth_bytes_per_step=MIB, culprit="replay",
                             culprit_bytes_per_step=MIB)
    alone = leakreports.leak(901, "buffer `queue` grows every step", series="buffer `queue`",
                             culprit="queue", culprit_items_per_step=4.0)
    text = render_status(from_json(status_document(
        leakreports.leak_report((older, alone)))))
    assert [line.strip() for line in _leak_lines(text, 900)[1:]] == [
        "culprit `replay`: ~1.0 MiB/step"]
    (row,) = _leak_lines(text, 901)
    assert row.endswith("[+4 items/step]")


def test_the_document_carries_a_leaks_details_and_the_allocator_figures_as_json() -> None:
    doc = json.loads(json.dumps(status_document(leakreports.leak_report())))
    leaks = {f["pid"]: f["details"] for f in doc["findings"]}
    assert leaks[701]["culprit"] == "areal.infra.rpc.rtensor._fetch_buffer"
    assert leaks[701]["found_by"] == "discovered"
    assert leaks[701]["culprit_items_per_step"] == 16.0
    assert leaks[702]["trace"] == {
        "status": "done", "why": "", "steps": 20,
        "sites": [{"site": "leaky.py:42", "bytes_per_step": 3 * MIB, "count_per_step": 1.0},
                  {"site": "data/loader.py:88", "bytes_per_step": 4096,
                   "count_per_step": 0.5}],
        "traceback": ["train.py:120", "model/step.py:57", "leaky.py:42"]}
    assert leaks[703]["found_by"] is None and leaks[703]["trace"]["status"] == "refused"
    agents = {p["pid"]: p["agent"] for p in doc["processes"]}
    assert {k: v for k, v in agents[700].items() if k.startswith("cuda_")} == {
        "cuda_allocated_bytes": 3 * GIB, "cuda_reserved_bytes": 5 * GIB,
        "cuda_active_bytes": 3 * GIB + MIB, "cuda_allocations": 812}
    # A process whose agent sends no allocator figures: unknown, not 0.
    assert agents[701]["cuda_active_bytes"] is None and agents[701]["cuda_allocations"] is None


def test_status_takes_verbose(fake_node: FakeNode, cli_env: dict[str, str]) -> None:
    result = gpuwatch(["status", "--verbose"], cli_env)
    assert result.returncode == EXIT_OK, result.stderr
    assert "GPU  NAME" in result.stdout


def test_an_instrumented_process_shows_its_agents_step_and_buffers_under_its_row() -> None:
    doc = status_document(leakreports.leak_report())
    lines = render_status(from_json(doc), width=0).splitlines()
    at = next(i for i, line in enumerate(lines) if re.match(r"^700\s", line))
    assert lines[at + 1].strip() == (
        "agent: step 74 (advanced 1 s ago); CUDA allocated 3.0 GiB, reserved 5.0 GiB; "
        "buffer `fetch_buffer`: 74 items, 148.0 MiB")
    # The command's column, where top's notes go too; the same phrases as top's details.
    assert lines[at + 1].index("agent") == 16
    from gpuwatch.sinks.top.view import details_lines
    details = " ".join(line.text for line in details_lines(from_json(doc), 700, None, 200))
    assert "step 74 (advanced 1 s ago)" in details and "`fetch_buffer`: 74 items" in details
    # On an 80-column terminal the line breaks between its parts, never inside a figure.
    narrow = render_status(from_json(doc), width=80).splitlines()
    at = next(i for i, line in enumerate(narrow) if re.match(r"^700\s", line))
    under = []
    for line in narrow[at + 1:]:
        if not line.startswith(" "):
            break
        under.append(line)
    assert all(len(line) <= 80 for line in under)
    assert " ".join(line.strip() for line in under).replace("; ", ";") == lines[at + 1].strip(
        ).replace("; ", ";")


#: A line that ends in a figure, and a next line that starts with its unit.
_ENDS_IN_FIGURE = re.compile(r"\d$")
_STARTS_WITH_UNIT = re.compile(r"^(?:[KMGTPE]i?B|B|ms|s|sec|min|h|d|%)(?!\w)")


def test_a_wrapped_line_never_parts_a_figure_from_its_unit_at_any_width() -> None:
    """'48.0' at the end of one line and 'MiB' at the start of the next reads as two things:
    the agent's line under a row (its step's age, its buffers' sizes) and the reasons (growth
    per step, when memory runs out) keep each figure with its unit at every width."""
    report = from_json(status_document(leakreports.leak_report()))
    parted = {}
    for width in range(40, 121):
        lines = render_status(report, width=width).splitlines()
        pairs = [f"{a.rstrip()!r} / {b.lstrip()!r}" for a, b in zip(lines, lines[1:])
                 if _ENDS_IN_FIGURE.search(a.rstrip()) and _STARTS_WITH_UNIT.match(b.lstrip())]
        if pairs:
            parted[width] = pairs
    assert not parted, "\n".join(f"width {w}: {p}" for w, ps in parted.items() for p in ps)


def _crowded_report(processes: int) -> NodeReport:
    """The leak report with `processes` more processes, each with a command line as long as the
    read keeps (4 KiB) and three long launch variables, none holding GPU memory."""
    report = leakreports.leak_report()
    env = MappingProxyType({key: key[0] * 1024 for key in ("RANK", "MASTER_ADDR", "JOB_NAME")})
    many = {pid: evolve(leakreports.process(pid), cmdline=("python3", f"{pid}" * 800),
                        launch_env=env, gpu_usage=())
            for pid in range(10_000, 10_000 + processes)}
    snapshot = replace(report.snapshot, processes=MappingProxyType(
        {**report.snapshot.processes, **many}))
    return NodeReport(snapshot, report.findings)


def test_a_document_over_its_bound_is_served_shortened_and_says_so() -> None:
    """The daemon serves at most MAX_DOCUMENT_BYTES of status document: texts shortened first,
    then the processes that matter least left out (never a GPU holder or one a finding names),
    said in source_detail and as an error; the rest reads back. One within it is as it was."""
    report = _crowded_report(2500)
    doc = status_document(report, source="daemon")
    assert len(json.dumps(doc)) > MAX_DOCUMENT_BYTES
    named = {f.pid for f in report.findings}
    for limit, left_out in ((MAX_DOCUMENT_BYTES, False), (2 * MIB, True)):
        body, cut = bounded_json(doc, limit)
        assert len(body) <= limit and cut is not None
        served = json.loads(body)
        assert served["errors"][-1] == {"source": "document", "message": cut}
        assert cut in served["source_detail"] and "texts shortened" in cut
        shown = processes_by_pid(served)
        assert named <= shown.keys()
        assert (len(shown) < len(doc["processes"])) == left_out
        assert ("processes left out" in cut) == left_out
        crowd = shown[10_001]
        assert crowd["cmdline"][-1] == DOCUMENT_CUT and len("".join(crowd["cmdline"])) < 300
        assert all(v.endswith(DOCUMENT_CUT) for v in crowd["launch_env"].values())
        assert from_json(served).source_detail == served["source_detail"]
    small = status_document(leakreports.leak_report(), source="daemon")
    assert bounded_json(small) == (json.dumps(small).encode(), None)


def test_a_document_reads_back_into_the_models_types_and_renders_again_byte_for_byte() -> None:
    """What the command line reads from the daemon's state socket is read once, at the edge,
    into the types the reaper, `top` and the views work on; nothing is lost or changed on the
    way (status_json checks the same of every real document the tests read)."""
    for report in (leakreports.leak_report(), leakreports.leak_report(())):
        text = json.dumps(status_document(report, source="daemon"))
        back = from_json(json.loads(text))
        assert json.dumps(status_document(back)) == text
        assert back.source == "daemon" and back.snapshot.clock_step == 0.0
        assert [f.kind for f in back.findings] == [f.kind for f in report.findings]
        assert all(isinstance(f.kind, Kind) for f in back.findings)


def test_the_json_exit_code_read_off_the_document_is_the_reports() -> None:
    """`status --json` prints the document as it came and reads its exit code off it, without
    reading it into the model: the code is the one the report gives."""
    from gpuwatch.commands.status import exit_code
    from gpuwatch.commands.status_json import document_exit_code
    from gpuwatch.model import GpuDevice, NvmlCallError

    report = leakreports.leak_report()
    snapshot = replace(report.snapshot, gpus=(GpuDevice(index=0), GpuDevice(index=1)))
    report = replace(report, snapshot=snapshot)
    broken = GpuDevice(index=1, errors=(NvmlCallError("nvmlDeviceGetMemoryInfo", 15,
                                                      "GPU is lost"),))
    variants = [
        report,
        replace(report, snapshot=replace(snapshot, gpus=(snapshot.gpus[0], broken))),
        replace(report, snapshot=replace(snapshot, nvml=replace(snapshot.nvml,
                                                                available=False))),
    ]
    codes = [exit_code(r) for r in variants]
    assert codes == [EXIT_OK, EXIT_PARTIAL, EXIT_NVML_UNAVAILABLE]
    for r, code in zip(variants, codes):
        doc = json.loads(json.dumps(status_document(r)))
        assert document_exit_code(doc) == code == exit_code(from_json(doc))
