"""gpuwatch's agent at interpreter start, for programs that never import it.

With this directory first on PYTHONPATH (`gpuwatch run` puts it there; `gpuwatch agent-path`
prints it), Python's `site` imports this module at start. When GPUWATCH_AGENT is `auto` or `1`,
it puts a one-shot import hook in front of sys.meta_path: when the program imports
`torch.optim`, the hook removes itself and gpuwatch.agent._auto counts the optimizer's steps as
the program's steps (docs/agent.md). Until then nothing but the standard library is imported,
and a program that never imports torch pays for one string comparison per import. It also arms
a timer (one sleeping thread, and again in each forked child): a process that lives TICK_AFTER
seconds, torch or not (a data worker of a pure-Python pipeline, a preprocessor), then loads the
agent and reports on a timer until its first step, so that its growth is tested too; a `pip` or
a `python -c` of the job that ends sooner never loads it.

Whatever GPUWATCH_AGENT says, the `sitecustomize` that this one hides (the next on sys.path) is
imported after it, as if this one were not there. Nothing here may break the program: every
failure is one line on stderr, and the program runs on without the agent.
"""

from __future__ import annotations

import contextlib  # loaded at start already, as os and sys are
import os
import sys

# typing is not loaded at start in every Python: importing it would cost every process.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Sequence
    from typing import Any, Optional

_ON = ("auto", "1")
_TARGET = "torch.optim"
#: A process of the job that has lived this long (from its start, or from its fork) loads the
#: agent and reports on a timer until its first step.
TICK_AFTER = 5.0


def _say(what: str) -> None:
    try:
        sys.stderr.write(f"gpuwatch: agent bootstrap: {what}\n")
        sys.stderr.flush()
    except Exception:
        pass


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:300]


_WITHOUT = "; the program runs without the agent"


class _OptimizerHook:
    """Fires once, on the import of torch.optim: finds the module as the other finders would,
    and has its loader install the step counter once the module has run."""

    def find_spec(self, fullname: str, path: Optional[Sequence[str]] = None,
                  target: Any = None) -> Any:
        if fullname != _TARGET:
            return None
        _remove_hook()
        try:
            spec = None
            for finder in list(sys.meta_path):
                find = getattr(finder, "find_spec", None)
                if find is None:
                    continue
                spec = find(fullname, path, target)
                if spec is not None:
                    break
            loader: Any = getattr(spec, "loader", None)
            exec_module = getattr(loader, "exec_module", None)
            if spec is None or exec_module is None:
                return spec

            def exec_then_count(module: Any) -> None:
                try:
                    exec_module(module)
                finally:
                    # The loader is this module's own (one per file): undo, then count.
                    with contextlib.suppress(Exception):
                        del loader.exec_module
                _install_counter()

            loader.exec_module = exec_then_count
            return spec
        except Exception as exc:
            _say(f"could not watch for torch.optim ({_describe(exc)}){_WITHOUT}")
            return None


def _remove_hook() -> None:
    with contextlib.suppress(Exception):
        sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _OptimizerHook)]


def _install_counter() -> None:
    try:
        from gpuwatch.agent import _auto
        _auto.install()
    except Exception as exc:
        _say(f"could not count optimizer steps ({_describe(exc)}){_WITHOUT}")


def _tick_later() -> None:
    """The timer's thread: after TICK_AFTER seconds, the agent reports on a timer until the
    first step (the agent's own call does nothing where it already ticks or has stepped)."""
    try:
        import time
        time.sleep(TICK_AFTER)
        if sys.is_finalizing():
            return
        import gpuwatch.agent
        gpuwatch.agent.tick_until_stepped()
    except BaseException as exc:
        with contextlib.suppress(BaseException):
            if not sys.is_finalizing():
                _say(f"could not report on a timer ({_describe(exc)}){_WITHOUT}")


def _arm() -> None:
    """One thread that sleeps, then ticks: a raw _thread (threading is not loaded at start in
    every Python, and the thread must never keep the program alive). It starts with every
    signal blocked, as the agent's ticker does (gpuwatch.agent._hooks.start_without_signals):
    a signal sent to the program goes to a thread of the program's own."""
    try:
        import _signal  # type: ignore[import-not-found]  # signal's C half, no enum built
        import _thread
        mask = getattr(_signal, "pthread_sigmask", None)
        if mask is None:
            _thread.start_new_thread(_tick_later, ())
            return
        old = mask(_signal.SIG_BLOCK, _signal.valid_signals())
        try:
            _thread.start_new_thread(_tick_later, ())
        finally:
            mask(_signal.SIG_SETMASK, old)
    except Exception as exc:
        _say(f"could not start the timer ({_describe(exc)}){_WITHOUT}")


def _start() -> None:
    try:
        if os.environ.get("GPUWATCH_AGENT", "").strip().lower() not in _ON:
            return
        if _TARGET in sys.modules:  # not at start, then: counted from here on
            _install_counter()
        elif not any(isinstance(f, _OptimizerHook) for f in sys.meta_path):
            sys.meta_path.insert(0, _OptimizerHook())
        _arm()
        # A forked child (a multiprocessing worker) has none of its parent's threads.
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=_arm)
    except Exception as exc:
        _say(f"could not start ({_describe(exc)}){_WITHOUT}")


def _same_dir(entry: str, here: str) -> bool:
    try:
        return os.path.realpath(entry or os.curdir) == here
    except Exception:
        return False


def _chain() -> None:
    """Import the sitecustomize this one hides, as `site` would have: with this directory out of
    the search; sys.path and this module's place in sys.modules put back after."""
    me = sys.modules.get(__name__)
    if __name__ != "sitecustomize":
        return  # imported as gpuwatch.agent.bootstrap.sitecustomize: nothing is hidden
    saved = list(sys.path)
    try:
        here = os.path.realpath(os.path.dirname(os.path.abspath(__file__)))
        sys.path[:] = [p for p in sys.path if not _same_dir(p, here)]
        del sys.modules["sitecustomize"]
        try:
            import importlib
            importlib.import_module("sitecustomize")
        except ImportError as exc:
            if exc.name != "sitecustomize":
                _say(f"the next sitecustomize failed ({_describe(exc)})")
        except Exception as exc:
            _say(f"the next sitecustomize failed ({_describe(exc)})")
    except Exception as exc:
        _say(f"could not look for the next sitecustomize ({_describe(exc)})")
    finally:
        try:
            sys.path[:] = saved
            if me is not None:
                sys.modules["sitecustomize"] = me
        except Exception:
            pass


_start()
_chain()
