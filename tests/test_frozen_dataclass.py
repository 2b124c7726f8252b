"""gpuwatch.frozen's classes behave as `@dataclass(frozen=True)`'s: the same repr, equality and
hash, the same frozen-ness, the same dataclass functions."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional

import pytest

from gpuwatch.config import Config
from gpuwatch.frozen import build, evolve, frozen_dataclass, memo
from gpuwatch.model import BufferSize, HostProcess, Job


def _pair(*specs: tuple[str, Any]) -> tuple[type, type]:
    """The same class body, once through dataclass and once through frozen_dataclass."""
    def body() -> dict[str, Any]:
        return {"__annotations__": {name: "Any" for name, _ in specs},
                **{name: value for name, value in specs if value is not None}}
    return (dataclass(frozen=True)(type("C", (), body())),
            frozen_dataclass(type("C", (), body())))


@pytest.mark.parametrize("specs", [
    (("a", None),),
    (("a", None), ("b", 2)),
    (("a", None), ("b", field(default=2, compare=False))),
    (("a", None), ("b", field(default=2, repr=False))),
    (("a", None), ("b", field(default=2, hash=False))),
    (("a", None), ("b", field(default=2, compare=False, hash=True))),
])
def test_repr_eq_and_hash_are_dataclass_s(specs: tuple[tuple[str, Any], ...]) -> None:
    ref, ours = _pair(*specs)
    for args in ((1,), (1, 3), ("x", None)):
        if len(args) > len(specs):
            continue
        r1, r2 = ref(*args), ref(*args[:1])
        o1, o2 = ours(*args), ours(*args[:1])
        assert repr(o1) == repr(r1)
        assert (o1 == o2) == (r1 == r2) and (o1 != o2) == (r1 != r2)
        assert hash(o1) == hash(r1)
        assert o1 != r1  # another class: never equal, as dataclass's own
        with pytest.raises(dataclasses.FrozenInstanceError):
            o1.a = 5
        assert dataclasses.astuple(o1) == dataclasses.astuple(r1)
        assert dataclasses.replace(o1, a=7).a == 7


def test_a_class_without_a_docstring_is_named_with_its_fields_and_one_with_keeps_its_own() -> None:
    """dataclass would describe an undocumented class by its signature, through
    inspect.signature (0.45 ms of importing gpuwatch.config); its fields' names say as much."""
    ours = frozen_dataclass(type("C", (), {"__annotations__": {"a": "int", "b": "str"}}))
    assert ours.__doc__ == "C(a, b)"
    documented = frozen_dataclass(type("D", (), {"__doc__": "What D is.",
                                                 "__annotations__": {"a": "int"}}))
    assert documented.__doc__ == "What D is."
    assert ours(1, "x") == ours(a=1, b="x") and documented(a=1).a == 1


def test_a_recursive_repr_does_not_recurse_forever() -> None:
    _, ours = _pair(("a", None))
    box: list[Any] = []
    o = ours(box)
    box.append(o)
    assert repr(o) == "C(a=[...])"


def test_the_model_and_the_config_compare_hash_and_show_as_before() -> None:
    job = Job("41234", "slurm")
    assert job == Job("41234", "slurm") and job != Job("41235", "slurm")
    assert hash(job) == hash(("41234", "slurm"))
    assert repr(job) == "Job(id='41234', source='slurm')"
    assert BufferSize(items=1, bytes=2) == BufferSize(1, 2)
    assert repr(BufferSize(1, 2)) == "BufferSize(items=1, bytes=2)"
    p = HostProcess(pid=7, job=job)
    assert p == dataclasses.replace(p) and p != dataclasses.replace(p, pid=8)
    assert repr(p).startswith("HostProcess(pid=7, in_procfs=True, ppid=None,")
    with pytest.raises(TypeError):  # a mapping field: unhashable, as with dataclass's __hash__
        hash(p)
    assert Config() == Config()
    assert hash(Config().daemon) == hash(Config().daemon)
    optional: Optional[int] = None
    assert Job("1", "run").__eq__(optional) is NotImplemented


def test_evolve_makes_what_replace_makes_and_leaves_the_original_as_it_was() -> None:
    p = HostProcess(pid=7, ppid=1, name="python", cmdline=("python", "train.py"),
                    job=Job("42", "slurm"))
    evolved = evolve(p, uss_bytes=4096, rss_bytes=1 << 20)
    assert evolved == dataclasses.replace(p, uss_bytes=4096, rss_bytes=1 << 20)
    assert repr(evolved) == repr(dataclasses.replace(p, uss_bytes=4096, rss_bytes=1 << 20))
    assert p.uss_bytes is None and p.rss_bytes is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        evolved.pid = 8  # type: ignore[misc]
    with pytest.raises(TypeError, match="no field nope"):
        evolve(p, nope=1)


def test_what_a_record_works_out_once_is_worked_out_again_for_its_evolved_copy() -> None:
    """A process's identity and whether it holds a GPU are asked several times a poll and kept
    on the record; a copy with other fields (a pod's job, its private memory) has its own."""
    from gpuwatch.model import GpuProcessUsage

    p = HostProcess(pid=5, start_time=1.0)
    assert p.identity == (5, 1.0) and not p.holds_gpu  # worked out, and kept
    usage = (GpuProcessUsage(gpu_index=0, gpu_uuid=None, pid=6, memory_bytes=1),)
    q = evolve(p, pid=6, gpu_usage=usage)
    assert q.identity == (6, 1.0) and q.holds_gpu
    assert p.identity == (5, 1.0) and not p.holds_gpu
    assert q == HostProcess(pid=6, start_time=1.0, gpu_usage=usage)
    assert repr(q) == repr(HostProcess(pid=6, start_time=1.0, gpu_usage=usage))


def test_a_judgement_is_worked_out_once_per_settings_and_again_for_an_evolved_copy() -> None:
    """Whether a process is protected is asked of every process by two detectors at every
    poll: worked out once for a record and the settings asked with, again for other settings
    (a reloaded configuration) and for a copy made by evolve (its fields may differ)."""
    from gpuwatch.config import DetectorConfig
    from gpuwatch.detectors import is_protected, protected_by

    calls: list[tuple[int, object]] = []

    def judged(p: HostProcess, settings: object) -> int:
        calls.append((p.pid, settings))
        return p.pid

    first, second = object(), object()
    p = HostProcess(pid=5, start_time=1.0, user="alice")
    assert memo(judged, p, first) == memo(judged, p, first) == 5
    assert calls == [(5, first)]
    assert memo(judged, p, second) == 5 and calls[-1] == (5, second)
    q = evolve(p, pid=6)
    assert memo(judged, q, second) == 6 and calls[-1] == (6, second)
    assert p == HostProcess(pid=5, start_time=1.0, user="alice")  # equality sees fields only

    guarded = DetectorConfig(protected_users=("alice",))
    assert not is_protected(p, Config().detectors) and is_protected(p, guarded)
    assert protected_by(p, guarded) == "its user alice is in detectors.protected_users"
    assert not is_protected(evolve(p, user="bob"), guarded)


def test_build_makes_what_init_makes_from_every_field_and_refuses_fewer_or_others() -> None:
    values: dict[str, Any] = {f.name: getattr(HostProcess(pid=0), f.name)
                              for f in dataclasses.fields(HostProcess)}
    values.update(pid=7, ppid=1, name="python", cmdline=("python", "train.py"),
                  job=Job("42", "slurm"), uss_bytes=4096)
    built = build(HostProcess, dict(values))
    made = HostProcess(**values)
    assert built == made and repr(built) == repr(made)
    assert vars(built) == vars(made)
    with pytest.raises(dataclasses.FrozenInstanceError):
        built.pid = 8  # type: ignore[misc]
    with pytest.raises(TypeError, match="not given: uss_bytes"):
        build(HostProcess, {k: v for k, v in values.items() if k != "uss_bytes"})
    with pytest.raises(TypeError, match="no such field: nope"):
        build(HostProcess, {**values, "nope": 1})
