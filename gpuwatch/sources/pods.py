"""Kubernetes pods by UID: namespace, name, container names, the GPUs the kubelet allocated each
container, and whether the kubelet still lists the pod. No cluster credentials: only what the
node itself keeps.

A process's cgroup names its pod by UID (gpuwatch.sources.jobs) and its container by id. The
names come from the node's records:

- the kubelet's PodResources service (gpuwatch.sources.podresources): the pods it runs, by
  namespace and name, with each container's devices. It says no UID;
- the kubelet's pod log directories, `/var/log/pods/NAMESPACE_NAME_UID/CONTAINER/`: the join
  from UID to namespace and name, and the pod's container names (a namespace and a pod name
  hold no `_`, so the split is exact);
- the kubelet's container log links, `/var/log/containers/POD_NAMESPACE_CONTAINER-ID.log`
  (the sibling of the pod log directories): a container id's own name, in a pod of several
  containers, where the runtime's records are not mounted. Only the names are read: each entry
  is a link into /var/log/pods, never followed;
- the container runtime's record of a container (its OCI config.json: containerd's
  `/run/containerd/io.containerd.runtime.v2.task/k8s.io/ID/config.json`, CRI-O's
  `/run/containers/storage/overlay-containers/ID/userdata/config.json`), whose annotations
  name the pod and the container (`io.kubernetes.cri.sandbox-namespace`,
  `io.kubernetes.pod.name`, `io.kubernetes.container.name`, ...): the container's own name, and
  the pod's names where there are no log directories.

All of it is read off the poll loop, by a thread of its own (`PodSource.start`): a kubelet that
does not answer costs that thread its call's deadline and never a poll. The poll reads the last
good map (`PodSource.lookup`), and a UID it has no names for wakes the thread, so the names are
there by the next poll. The records are root's, yet each read is bounded in bytes and counts
(MAX_RECORD_BYTES, MAX_POD_DIRS) and never follows a symbolic link.
"""

from __future__ import annotations

import json
import os
import re
import stat
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Callable, Optional

from gpuwatch.bounded_read import read_at_most
from gpuwatch.model import Pod
from gpuwatch.sources.podresources import (
    DEFAULT_SOCKET,
    PodList,
    PodResourcesClient,
    Unavailable,
    grpc_missing,
    is_socket,
)
from gpuwatch.threads import start_without_signals

DEFAULT_POD_LOGS_DIR = "/var/log/pods"
#: containerd's task directories of the CRI's namespace, and CRI-O's container storage.
DEFAULT_RUNTIME_DIRS = ("/run/containerd/io.containerd.runtime.v2.task/k8s.io",
                        "/run/containers/storage/overlay-containers")
#: An OCI config.json is tens of kilobytes (the environment, the mounts); past this it is not
#: read.
MAX_RECORD_BYTES = 1 << 20
#: Directories of /var/log/pods looked at, and containers of each.
MAX_POD_DIRS = 4096
MAX_POD_CONTAINERS = 64
#: Pods and containers whose names are kept once seen (a pod deleted keeps its name for the
#: orphan it leaves), least recently looked up dropped first.
MAX_REMEMBERED = 4096

_NAMESPACE = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
_POD_NAME = re.compile(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?")
_CONTAINER_NAME = _NAMESPACE
_UID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}|[0-9a-f]{32}")
_CONTAINER_ID = re.compile(r"[0-9a-f]{64}")

# The annotations the CRI runtimes put on a container's OCI spec: containerd's, then CRI-O's
# (and the kubelet's labels, which CRI-O also writes as annotations).
_ANNOTATIONS = {
    "namespace": ("io.kubernetes.cri.sandbox-namespace", "io.kubernetes.pod.namespace"),
    "pod": ("io.kubernetes.cri.sandbox-name", "io.kubernetes.pod.name"),
    "uid": ("io.kubernetes.cri.sandbox-uid", "io.kubernetes.pod.uid"),
    "container": ("io.kubernetes.cri.container-name", "io.kubernetes.container.name"),
}


@dataclass(frozen=True)
class PodNames:
    namespace: str
    name: str
    #: The containers the node's records name for it.
    containers: frozenset[str] = frozenset()
    source: str = "pod-logs"


@dataclass(frozen=True)
class ContainerRecord:
    """What the runtime's record of one container says."""

    pod_uid: str
    namespace: str
    pod: str
    container: str
    runtime: str  # "containerd" | "cri-o" | "container-logs"


#: A container log link's name: POD_NAMESPACE_CONTAINER-ID.log.
_CONTAINER_LOG = re.compile(r"(?P<pod>[^_]+)_(?P<namespace>[^_]+)_(?P<container>[^_]+)-"
                            r"(?P<id>[0-9a-f]{64})\.log")


def container_logs_dir(pod_logs_dir: str) -> str:
    """The container log links' directory, beside the pod log directories (/var/log/pods ->
    /var/log/containers)."""
    return os.path.join(os.path.dirname(pod_logs_dir.rstrip("/")), "containers")


def read_container_log_links(root: str, wanted: Iterable[str],
                             pods: Mapping[str, PodNames]) -> dict[str, ContainerRecord]:
    """Container id -> its record, for the `wanted` ids the kubelet's container log links name
    (POD_NAMESPACE_CONTAINER-ID.log), in a pod `pods` (UID -> names, from the pod log
    directories) knows. Only the entries' names are read (at most MAX_POD_DIRS x
    MAX_POD_CONTAINERS of them); the links are never followed."""
    wanted = set(wanted)
    found: dict[str, ContainerRecord] = {}
    if not wanted:
        return found
    uids = {(n.namespace, n.name): uid for uid, n in pods.items()}
    for entry in _entries(root, MAX_POD_DIRS * MAX_POD_CONTAINERS):
        m = _CONTAINER_LOG.fullmatch(entry.name)
        if m is None or m["id"] not in wanted:
            continue
        namespace, pod, container = m["namespace"], m["pod"], m["container"]
        uid = uids.get((namespace, pod))
        if uid is None or not _CONTAINER_NAME.fullmatch(container):
            continue
        found[m["id"]] = ContainerRecord(uid, namespace, pod, container, "container-logs")
    return found


def _entries(root: str, limit: int) -> list[os.DirEntry[str]]:
    """At most `limit` entries of the directory `root` (none where it cannot be read)."""
    try:
        with os.scandir(root) as entries:
            return [entry for _, entry in zip(range(limit), entries)]
    except OSError:
        return []


# -- the node's records --------------------------------------------------------------------

def read_pod_log_dirs(root: str) -> dict[str, PodNames]:
    """UID -> names from the kubelet's pod log directories (NAMESPACE_NAME_UID/CONTAINER/).
    Entries that are not directories (a link included) or not of that shape are skipped."""
    found: dict[str, PodNames] = {}
    for entry in _entries(root, MAX_POD_DIRS):
        parts = entry.name.split("_")
        if len(parts) != 3 or not entry.is_dir(follow_symlinks=False):
            continue
        namespace, name, uid = parts
        if not (_NAMESPACE.fullmatch(namespace) and _POD_NAME.fullmatch(name)
                and _UID.fullmatch(uid)):
            continue
        found[uid] = PodNames(namespace, name, _containers_in(entry.path))
    return found


def _containers_in(path: str) -> frozenset[str]:
    return frozenset(entry.name for entry in _entries(path, MAX_POD_CONTAINERS)
                     if _CONTAINER_NAME.fullmatch(entry.name)
                     and entry.is_dir(follow_symlinks=False))


def read_container_record(runtime_dirs: Iterable[str], container_id: str
                          ) -> Optional[ContainerRecord]:
    """The pod and container names the runtime recorded for `container_id`, from the first of
    `runtime_dirs` that has its config.json (ID/config.json: containerd's layout;
    ID/userdata/config.json: CRI-O's)."""
    if not _CONTAINER_ID.fullmatch(container_id):
        return None
    for root in runtime_dirs:
        for inner, runtime in (((container_id, "config.json"), "containerd"),
                               ((container_id, "userdata", "config.json"), "cri-o")):
            raw = _read_below(root, inner, MAX_RECORD_BYTES)
            if raw is None:
                continue
            record = _record_of(raw, runtime)
            if record is not None:
                return record
    return None


def _read_below(root: str, parts: tuple[str, ...], limit: int) -> Optional[bytes]:
    """The file at root/parts..., opened one component at a time with O_NOFOLLOW (a link
    anywhere below `root` is not followed), only when it is a regular file of at most `limit`
    bytes; None otherwise."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(root, flags | os.O_DIRECTORY)
    except OSError:
        return None
    try:
        for part in parts[:-1]:
            inner = os.open(part, flags | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = inner
        inner = os.open(parts[-1], flags | os.O_NONBLOCK, dir_fd=fd)
        os.close(fd)
        fd = inner
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > limit:
            return None
        data = read_at_most(fd, limit)
        return data if len(data) <= limit else None
    except OSError:
        return None
    finally:
        os.close(fd)


def _record_of(raw: bytes, runtime: str) -> Optional[ContainerRecord]:
    try:
        spec = json.loads(raw)
    except ValueError:
        return None
    annotations = spec.get("annotations") if isinstance(spec, dict) else None
    if not isinstance(annotations, dict):
        return None
    values: dict[str, str] = {}
    for what, keys in _ANNOTATIONS.items():
        value = next((annotations[k] for k in keys if isinstance(annotations.get(k), str)), None)
        if value is None:
            return None
        values[what] = value
    if not (_NAMESPACE.fullmatch(values["namespace"]) and _POD_NAME.fullmatch(values["pod"])
            and _UID.fullmatch(values["uid"]) and _CONTAINER_NAME.fullmatch(values["container"])):
        return None
    return ContainerRecord(values["uid"], values["namespace"], values["pod"],
                           values["container"], runtime)


# -- the source ----------------------------------------------------------------------------

@dataclass(frozen=True)
class PodSourceStatus:
    """What `doctor` and the logs say about the pod source."""

    #: "kubelet" when the kubelet answered last, else "pod-logs", "containerd", "cri-o" for
    #: the records that named pods, or "none".
    answered_by: str
    socket_path: str
    #: Why the kubelet was not asked or did not answer, at its last try (None when it answered).
    kubelet_error: Optional[str]
    #: When the kubelet last answered (steady clock), and how many pods it listed.
    kubelet_answered_at: Optional[float]
    kubelet_pods: int
    #: Pods named by the pod log directories at the last look.
    pod_log_pods: int
    #: Containers named by the runtime's records.
    runtime_containers: int
    refreshes: int
    #: What the bounds of the kubelet's answers left out, by what.
    cut: Mapping[str, int] = field(default_factory=dict)
    #: Calls to the kubelet so far that it answered, and that failed (no answer within the
    #: timeout, a refusal, an answer that is not the protocol's); a socket absent is not asked.
    calls_answered: int = 0
    calls_failed: int = 0


@dataclass(frozen=True)
class _Kubelet:
    listed: frozenset[tuple[str, str]]
    allocated: Mapping[tuple[str, str], Mapping[str, tuple[str, ...]]]
    dynamic: frozenset[tuple[str, str]]
    #: The pods (namespace, name) the last answers lacked: how many answers in a row, since
    #: when (the first such answer's time).
    missing: Mapping[tuple[str, str], tuple[int, float]]
    answered_at: float


class PodSource:
    """Pod names and allocations, refreshed by a thread of its own (`start`), read by the poll
    (`lookup`) without waiting on anything."""

    def __init__(self, socket_path: str = DEFAULT_SOCKET,
                 pod_logs_dir: str = DEFAULT_POD_LOGS_DIR,
                 runtime_dirs: Iterable[str] = DEFAULT_RUNTIME_DIRS,
                 refresh: float = 5.0, timeout: float = 2.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.socket_path = socket_path
        self.pod_logs_dir = pod_logs_dir
        self.runtime_dirs = tuple(runtime_dirs)
        self.refresh = refresh
        self.clock = clock
        self._client = PodResourcesClient(socket_path, timeout)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        # Published by the refresher as a whole; read by the poll without a lock.
        self._names: Mapping[str, PodNames] = MappingProxyType({})
        self._containers: Mapping[str, ContainerRecord] = MappingProxyType({})
        self._kubelet: Optional[_Kubelet] = None
        # The Pod records lookup made from the published state (names, kubelet) it was made of.
        self._built: tuple[object, object, dict[str, Pod]] = (None, None, {})
        # Written by the poll under the lock: when each pod UID was first asked for, and the
        # containers it asked for and found no names for.
        self._seen: OrderedDict[str, float] = OrderedDict()
        self._wanted_containers: set[str] = set()
        self._remembered_uids: OrderedDict[str, PodNames] = OrderedDict()
        self._remembered_containers: OrderedDict[str, ContainerRecord] = OrderedDict()
        self._kubelet_error: Optional[str] = None
        self._pod_log_pods = 0
        self._refreshes = 0
        self._calls_answered = 0
        self._calls_failed = 0
        self._cut: dict[str, int] = {}

    # -- the refresher --

    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="gpuwatch-pods", daemon=True)
        start_without_signals(self._thread)

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self._client.close()

    def _run(self) -> None:
        if self._refreshes:  # a first look was made already (`lookup`, not started)
            self._wake.wait(self.refresh)
            self._wake.clear()
        while not self._stop.is_set():
            self.refresh_once()
            self._wake.wait(self.refresh)
            self._wake.clear()

    def refresh_once(self) -> None:
        """Read the records and ask the kubelet once (at most its call's deadline)."""
        with self._lock:
            seen = dict(self._seen)
            wanted_containers = set(self._wanted_containers)
        logs = read_pod_log_dirs(self.pod_logs_dir) if self.pod_logs_dir else {}
        records = {cid: r for cid in wanted_containers
                   if (r := read_container_record(self.runtime_dirs, cid)) is not None}
        if self.pod_logs_dir and wanted_containers - records.keys():
            records.update(read_container_log_links(
                container_logs_dir(self.pod_logs_dir), wanted_containers - records.keys(),
                logs))
        answer: Optional[PodList] = None
        error: Optional[str] = None
        started = self.clock()
        asked = False
        if not self.socket_path:
            error = "not configured (kubernetes.pod_resources_socket is empty)"
        elif not is_socket(self.socket_path):
            error = f"no socket at {self.socket_path}"
        else:
            asked = True
            try:
                answer = self._client.list()
            except Unavailable as e:
                error = str(e)
        kubelet = self._kubelet
        if answer is not None:
            kubelet = self._next_kubelet(answer, started, seen)
        with self._lock:
            for uid, names in logs.items():
                self._remember(self._remembered_uids, uid, names)
            for cid, record in records.items():
                self._remember(self._remembered_containers, cid, record)
                if record.pod_uid not in logs:
                    self._remember(self._remembered_uids, record.pod_uid,
                                   PodNames(record.namespace, record.pod,
                                            frozenset({record.container}), record.runtime))
            self._wanted_containers -= records.keys()
            self._names = MappingProxyType(dict(self._remembered_uids))
            self._containers = MappingProxyType(dict(self._remembered_containers))
            self._kubelet = kubelet
            self._kubelet_error = error
            self._pod_log_pods = len(logs)
            self._refreshes += 1
            if asked:
                if answer is not None:
                    self._calls_answered += 1
                else:
                    self._calls_failed += 1
            if answer is not None:
                for what, n in answer.cut.items():
                    self._cut[what] = self._cut.get(what, 0) + n

    def _next_kubelet(self, answer: PodList, started: float,
                      seen: Mapping[str, float]) -> _Kubelet:
        """The kubelet's answer, with the pods it lacks: those it listed before, and those whose
        processes were seen before the answer was asked for (a pod created just before an
        answer is not missing from it)."""
        listed = frozenset(answer.pods)
        before = self._kubelet
        known = set(before.listed) if before is not None else set()
        known |= set(before.missing) if before is not None else set()
        names = self._names
        for uid, first_seen in seen.items():
            pod = names.get(uid)
            if pod is not None and first_seen <= started:
                known.add((pod.namespace, pod.name))
        missing: dict[tuple[str, str], tuple[int, float]] = {}
        for key in known - listed:
            count, since = (before.missing.get(key, (0, started)) if before is not None
                            else (0, started))
            missing[key] = (count + 1, since)
        while len(missing) > MAX_REMEMBERED:
            missing.pop(min(missing, key=lambda k: missing[k][1]))
        allocated = {key: MappingProxyType(dict(p.containers)) for key, p in answer.pods.items()}
        return _Kubelet(listed=listed, allocated=MappingProxyType(allocated),
                        dynamic=frozenset(k for k, p in answer.pods.items()
                                          if p.dynamic_resources),
                        missing=MappingProxyType(missing), answered_at=started)

    @staticmethod
    def _remember(cache: OrderedDict, key: str, value: object) -> None:  # type: ignore[type-arg]
        cache[key] = value
        cache.move_to_end(key)
        while len(cache) > MAX_REMEMBERED:
            cache.popitem(last=False)

    # -- what the poll reads --

    def lookup(self, wanted: Mapping[str, Iterable[str]]
               ) -> tuple[Mapping[str, Pod], Mapping[str, str]]:
        """The pods of `wanted` (pod UID -> its processes' container ids) with the names known
        now, and each container id's name where known. Never waits: what is unknown is asked
        for, and the refresher wakes to find it before the next poll."""
        if self._thread is None and wanted:
            # Not started (a one-shot `status`, `top`): the first look is made now, bounded by
            # the kubelet's deadline, and later ones by the thread.
            self._note_wanted(wanted)
            self.refresh_once()
            self.start()
        names, records, kubelet = self._names, self._containers, self._kubelet
        built = self._built
        pods: dict[str, Pod] = {}
        container_names: dict[str, str] = {}
        unknown_uids, unknown_containers = [], []
        for uid, container_ids in wanted.items():
            pod_names = names.get(uid)
            for cid in container_ids:
                record = records.get(cid)
                if record is not None:
                    container_names[cid] = record.container
                elif cid:
                    unknown_containers.append(cid)
            if pod_names is None:
                unknown_uids.append(uid)
                continue
            # One Pod record per UID while the published state stays the same.
            if built[0] is not names or built[1] is not kubelet:
                built = (names, kubelet, {})
                self._built = built
            pod = built[2].get(uid)
            if pod is None:
                pod = built[2][uid] = self._pod(uid, pod_names, kubelet)
            pods[uid] = pod
            # One container: every process of the pod is in it.
            containers = (set(pods[uid].allocated) or set(pod_names.containers))
            if len(containers) == 1:
                only = next(iter(containers))
                for cid in container_ids:
                    container_names.setdefault(cid, only)
        # Woken once for each pod or container first seen unknown: one the node's records do
        # not name (not a pod's, or the records not mounted) waits for the next refresh
        # instead of costing a kubelet call at every poll.
        new = ([uid for uid in unknown_uids if uid not in self._seen]
               or [cid for cid in unknown_containers if cid not in self._wanted_containers])
        self._note_wanted({uid: () for uid in wanted}, unknown_containers)
        if new:
            self._wake.set()
        return MappingProxyType(pods), MappingProxyType(container_names)

    def _note_wanted(self, wanted: Mapping[str, Iterable[str]],
                     containers: Iterable[str] = ()) -> None:
        now = self.clock()
        containers = [*containers, *(c for cs in wanted.values() for c in cs if c)]
        with self._lock:
            for uid in wanted:
                self._seen.setdefault(uid, now)
                self._seen.move_to_end(uid)
            while len(self._seen) > MAX_REMEMBERED:
                self._seen.popitem(last=False)
            for cid in containers:
                if len(self._wanted_containers) >= MAX_REMEMBERED:
                    break
                if cid not in self._containers:
                    self._wanted_containers.add(cid)

    @staticmethod
    def _pod(uid: str, names: PodNames, kubelet: Optional[_Kubelet]) -> Pod:
        key = (names.namespace, names.name)
        if kubelet is None:
            return Pod(uid=uid, namespace=names.namespace, name=names.name, listed=None,
                       source=names.source)
        if key in kubelet.listed:
            return Pod(uid=uid, namespace=names.namespace, name=names.name,
                       allocated=kubelet.allocated.get(key, MappingProxyType({})), listed=True,
                       source="kubelet", dynamic_resources=key in kubelet.dynamic)
        count, since = kubelet.missing.get(key, (0, kubelet.answered_at))
        # Gone once two answers in a row lacked it: one may have been asked for while the
        # pod was being admitted.
        return Pod(uid=uid, namespace=names.namespace, name=names.name,
                   listed=False if count >= 2 else None,
                   gone_since=since if count >= 2 else None, source=names.source)

    def status(self) -> PodSourceStatus:
        with self._lock:
            kubelet, error = self._kubelet, self._kubelet_error
            records = len(self._containers)
            if kubelet is not None and error is None:
                by = "kubelet"
            elif self._pod_log_pods:
                by = "pod-logs"
            elif records:
                by = next(iter(self._containers.values())).runtime
            else:
                by = "none"
            return PodSourceStatus(
                answered_by=by, socket_path=self.socket_path, kubelet_error=error,
                kubelet_answered_at=kubelet.answered_at if kubelet is not None else None,
                kubelet_pods=len(kubelet.listed) if kubelet is not None else 0,
                pod_log_pods=self._pod_log_pods, runtime_containers=records,
                refreshes=self._refreshes, cut=dict(self._cut),
                calls_answered=self._calls_answered, calls_failed=self._calls_failed)


def kubelet_reachable(socket_path: str) -> tuple[bool, str]:
    """Whether the kubelet's PodResources socket is there and grpcio can ask it (for doctor)."""
    if not is_socket(socket_path):
        return False, f"no socket at {socket_path}"
    missing = grpc_missing()
    if missing is not None:
        return False, missing
    return True, socket_path


def pod_source(socket_path: str, pod_logs_dir: str, runtime_dirs: Iterable[str],
               refresh: float = 5.0, timeout: float = 2.0,
               clock: Callable[[], float] = time.monotonic) -> PodSource:
    """The daemon's pod source (config section [kubernetes]); an empty path is not read.
    `clock` is the poll's (gpuwatch.clock), so that a gone pod's time reads right in a
    snapshot."""
    return PodSource(socket_path or "", pod_logs_dir or "", tuple(d for d in runtime_dirs if d),
                     refresh=refresh, timeout=timeout, clock=clock)
