"""The kubernetes check: which of the node's records names the pods (gpuwatch.sources.pods): the
kubelet's PodResources service, the pod log directories, the container runtime's records."""

from __future__ import annotations

from pathlib import Path

from gpuwatch.doctor.base import OK, SKIP, WARN, Check, Context
from gpuwatch.sources.podresources import grpc_missing, is_socket
from gpuwatch.sources.pods import pod_source
from gpuwatch.units import plural


def check_kubernetes(ctx: Context) -> list[Check]:
    k = ctx.config.kubernetes
    socket_there = bool(k.pod_resources_socket) and is_socket(k.pod_resources_socket)
    logs_there = bool(k.pod_logs_dir) and Path(k.pod_logs_dir).is_dir()
    if not socket_there and not logs_there:
        return [Check("kubernetes", SKIP,
                      "skipped: not a Kubernetes node (no kubelet socket at "
                      f"{k.pod_resources_socket or '(not set)'}, no pod log directory at "
                      f"{k.pod_logs_dir or '(not set)'})")]
    source = pod_source(k.pod_resources_socket, k.pod_logs_dir, k.runtime_dirs,
                        timeout=min(k.timeout, ctx.timeout))
    source.refresh_once()
    source.stop()
    status = source.status()
    logs = (f"the pod log directories ({k.pod_logs_dir}: {plural(status.pod_log_pods, 'pod')})"
            if status.pod_log_pods else None)
    if status.answered_by == "kubelet":
        return [Check("kubernetes", OK,
                      f"the kubelet's PodResources ({k.pod_resources_socket}) answered: "
                      f"{plural(status.kubelet_pods, 'pod')} with their GPU allocations; "
                      f"pod UIDs named by {logs or 'the runtime records of their containers'}")]
    why = status.kubelet_error or "no answer"
    missing = grpc_missing() if socket_there else None
    fix = ("pip install 'gpuwatch[kubernetes]' (grpcio)" if missing else
           "mount /var/lib/kubelet/pod-resources read-only (deploy/kubernetes does)"
           if not socket_there else "check that the kubelet runs and serves PodResources")
    names = logs or "the container runtime's records (per container, as processes are seen)"
    return [Check("kubernetes", WARN,
                  f"the kubelet was not asked or did not answer ({why}): pods named by {names}; "
                  "no GPU allocations, and a deleted pod is not told from a live one",
                  fix=fix)]
