"""A real PyTorch training program with nothing in its loop but `agent.step()`, for the benchmark
of how soon a leak's culprit is named (bench/culprit_torch.py) and the tests that run PyTorch.

    python -m gpuwatch.simulate.torch_trainer --progress FILE [--step-seconds 0.3]
        [--leak-bytes 8388608 --leak-from 10 --holder dict|closure] [--process-group FILE]

It imports torch, torch.nn, torch.nn.functional, torch.optim, torch.utils.data and
torch.distributed, trains a small model on the CPU from a DataLoader and pads each step to
`--step-seconds`. From step `--leak-from` it keeps `--leak-bytes` a step: a tensor in the
module-level dict `_fetch_buffer` (`__main__._fetch_buffer`, the seed incident's shape), or with
`--holder closure` a bytes object in a closure's list, which no module reaches. Beside it a
bounded cache (16 tensors of 256 KiB, one new a step) fills up and stays full. With
`--process-group FILE` it joins a one-rank gloo process group (a file store at FILE) and never
destroys it: the agent reports that at exit.

One line per step goes to `--progress`: the step, the CPU time of the thread in `agent.step()` and
in the step's own compute (time.thread_time), the step's start (time.monotonic), and what the
agent was asked for after the step: 1 while it searches faster, plus 2 while it traces. A test
follows the first field; the benchmark the rest.
`--steps N` stops after N steps, with `--linger` seconds of teardown (as writing a last
checkpoint takes) after the agent's exit check.

With `--auto` it has no line of gpuwatch at all: run with the agent's bootstrap on PYTHONPATH
and GPUWATCH_AGENT=auto (as `gpuwatch run` runs it), the agent counts its optimizer steps. The
agent's CPU time is then what the optimizer step hooks take (each wrapped in a timer here), and
the step's compute is the rest. It also logs its loss as a program should
(`_total_loss += loss.item()`) and keeps the newest one (`_last_loss`, its graph replaced every
step), which the agent's discovery follows and must never call an autograd history.
"""

from __future__ import annotations

import argparse
import atexit
import collections
import sys
import time
from collections.abc import Iterator
from typing import Any

CACHE_ENTRY = 256 << 10
CACHE_ENTRIES = 16

_fetch_buffer: dict[int, Any] = {}  # the leak: a fetched tensor kept every step
_cache: collections.OrderedDict[int, Any] = collections.OrderedDict()  # bounded
#: With --auto, the loss logged the right way: `_total_loss += loss.item()`, and the newest loss
#: kept (`_last_loss`, one step's graph, replaced every step): neither may be called a leak.
_total_loss = 0.0
_last_loss: Any = None


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--progress", required=True)
    parser.add_argument("--step-seconds", type=float, default=0.3)
    parser.add_argument("--leak-bytes", type=int, default=0)
    parser.add_argument("--leak-from", type=int, default=10)
    parser.add_argument("--holder", choices=("dict", "closure"), default="dict")
    parser.add_argument("--steps", type=int, default=10_000_000)
    parser.add_argument("--process-group", default=None, metavar="FILE")
    parser.add_argument("--linger", type=float, default=0.0)
    parser.add_argument("--auto", action="store_true",
                        help="no agent.step(): the bootstrap's optimizer hook counts the steps")
    args = parser.parse_args(argv)
    global _total_loss, _last_loss

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    import torch.optim as optim
    import torch.utils.data as data
    from torch import nn

    hooked = [0.0]  # the thread's CPU time in the optimizer step hooks (--auto)
    if args.auto:
        agent: Any = None
        hooks = sys.modules["torch.optim.optimizer"]._global_optimizer_post_hooks
        if not hooks:
            print("torch_trainer: --auto, but no optimizer step hook is registered (is the "
                  "agent's bootstrap on PYTHONPATH, with GPUWATCH_AGENT=auto?)", file=sys.stderr)
            return 2

        def timed(hook: Any) -> Any:
            def run(*a: Any) -> Any:
                cpu = time.thread_time()
                try:
                    return hook(*a)
                finally:
                    hooked[0] += time.thread_time() - cpu
            return run

        for key, hook in list(hooks.items()):
            hooks[key] = timed(hook)
    else:
        from gpuwatch import agent

    torch.set_num_threads(1)
    if args.process_group:
        dist.init_process_group("gloo", init_method=f"file://{args.process_group}", rank=0,
                                world_size=1)
    if args.linger:
        # Registered before the agent's first use: atexit runs it after the agent's exit check.
        atexit.register(time.sleep, args.linger)

    def remember(step: int) -> None:
        _cache[step] = torch.ones(CACHE_ENTRY // 4)
        while len(_cache) > CACHE_ENTRIES:
            _cache.popitem(last=False)

    def make_fetch() -> Any:
        held = []

        def fetch(step: int) -> None:
            held.append(b"\x01" * args.leak_bytes)  # a closure's list: no module reaches it
        return fetch

    closure_fetch = make_fetch()

    def fetch(step: int) -> None:
        if args.holder == "dict":
            _fetch_buffer[step] = torch.ones(args.leak_bytes // 4)
        else:
            closure_fetch(step)

    def escalated() -> int:
        loaded = sys.modules.get("gpuwatch.agent")
        if loaded is None:
            return 0
        st: Any = loaded._st
        tracer = st.tracer
        return (int(time.monotonic() < st.search_until)
                | int(tracer is not None and tracer.active) << 1)

    model = nn.Sequential(nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 10))
    optimizer = optim.SGD(model.parameters(), lr=0.01)
    dataset = data.TensorDataset(torch.randn(2048, 128), torch.randint(0, 10, (2048,)))
    loader = data.DataLoader(dataset, batch_size=64, shuffle=True)

    def batches() -> Iterator[Any]:
        while True:
            yield from loader

    it = batches()
    with open(args.progress, "a", buffering=1) as progress:
        for step in range(args.steps):
            started = time.monotonic()
            cpu = time.thread_time()
            in_hooks = hooked[0]
            inputs, labels = next(it)
            loss = F.cross_entropy(model(inputs), labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if args.leak_bytes and step >= args.leak_from:
                fetch(step)
            remember(step)
            if args.auto:
                _total_loss += loss.item()
                _last_loss = loss
            computed = time.thread_time()
            if agent is not None:
                agent.step(step)
            stepped = time.thread_time()
            hook_s = hooked[0] - in_hooks
            progress.write(f"{step} {stepped - computed + hook_s:.7f} "
                           f"{computed - cpu - hook_s:.7f} {started:.4f} {escalated()}\n")
            time.sleep(max(0.0, args.step_seconds - (time.monotonic() - started)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
