"""Steps without a line in the program: each training step counted from the optimizers.

Installed by the bootstrap (gpuwatch/agent/bootstrap) once the program has imported
torch.optim: a post-step hook on every optimizer (torch's register_optimizer_step_post_hook).
One step per training step, however many optimizers a step runs (a GAN's generator and
discriminator, an actor and a critic): the first optimizer that steps is the clock, and each of
its steps is the program's next step; the others' steps count nothing. Should another optimizer
step twice while the clock does not (the first one was replaced, or kept but no longer used), it
becomes the clock. Once the program calls agent.step() itself, its steps win: the hook removes
itself and counts no more.
"""

from __future__ import annotations

import sys
import weakref
from typing import Any, Optional

import gpuwatch.agent as _agent


class StepCounter:
    """The post-step hook: optimizer steps in, one agent step per training step out."""

    def __init__(self) -> None:
        self.clock: Optional[weakref.ReferenceType[Any]] = None
        self.others: set[int] = set()
        self.steps = 0
        #: What the last step this counter recorded left in the agent: anything else there
        #: is a step the program recorded itself.
        self.mine: Any = None
        self.handle: Any = None

    def __call__(self, optimizer: Any, args: Any = None, kwargs: Any = None) -> None:
        try:
            last = _agent._st.last
            if last is not None and last is not self.mine:
                self.stop()
                return
            clock = self.clock() if self.clock is not None else None
            if clock is not None and optimizer is not clock:
                key = id(optimizer)
                if key not in self.others:
                    self.others.add(key)
                    return
            if optimizer is not clock:
                self.clock = weakref.ref(optimizer)
            self.others.clear()
            self.steps += 1
            _agent.step(self.steps)
            self.mine = _agent._st.last
        except Exception:
            pass

    def stop(self) -> None:
        handle, self.handle = self.handle, None
        if handle is not None:
            handle.remove()


_counter: Optional[StepCounter] = None


def install() -> StepCounter:
    """Count the program's optimizer steps as its steps (once; torch.optim already imported).
    Raises where this torch has no optimizer step hooks (before 2.0)."""
    global _counter
    if _counter is not None:
        return _counter
    optimizer_module = sys.modules["torch.optim.optimizer"]
    counter = StepCounter()
    counter.handle = optimizer_module.register_optimizer_step_post_hook(counter)
    _counter = counter
    # Until its first step (and in a forked data worker that never steps), on a timer.
    _agent.tick_until_stepped()
    return counter
