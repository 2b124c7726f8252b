"""The kubelet's PodResources v1 service: which pods run on the node, and the devices each of
their containers was allocated (`/v1.PodResourcesLister/List` on the kubelet's Unix socket,
`/var/lib/kubelet/pod-resources/kubelet.sock`, which needs no cluster credentials).

grpcio is optional (the `kubernetes` extra) and imported only when a socket is there to ask. The
answer is read by a small protobuf decoder of the few fields used here, not by generated code:
ListPodResourcesResponse { repeated PodResources pod_resources = 1 }, PodResources { name = 1,
namespace = 2, repeated ContainerResources containers = 3 }, ContainerResources { name = 1,
repeated ContainerDevices devices = 2, and whether dynamic_resources = 5 is there },
ContainerDevices { resource_name = 1, repeated device_ids = 2 }
(k8s.io/kubelet/pkg/apis/podresources/v1/api.proto). Every other field is
skipped by its wire type. The answer is bounded: MAX_ANSWER_BYTES at the transport, MAX_PODS,
MAX_CONTAINERS, MAX_DEVICES and MAX_NAME_BYTES in the decoder (what is past a bound is left out
and counted, never an error).
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Optional

#: The kubelet's socket where nothing else is configured.
DEFAULT_SOCKET = "/var/lib/kubelet/pod-resources/kubelet.sock"
METHOD = "/v1.PodResourcesLister/List"
#: The kubelet answers for at most a few hundred pods (--max-pods is 110 by default): 4 MiB (the
#: gRPC default) holds thousands of them.
MAX_ANSWER_BYTES = 4 << 20
MAX_PODS = 4096
MAX_CONTAINERS = 64
MAX_DEVICES = 256
#: A namespace or a container name is at most 63 bytes, a pod name 253; a device id (a MIG UUID
#: with a sharing suffix) well under this.
MAX_NAME_BYTES = 253

#: The resources whose devices are GPUs: the NVIDIA device plugin's `nvidia.com/gpu`,
#: `nvidia.com/mig-<profile>` under the mixed MIG strategy, and renamed shared resources
#: (`nvidia.com/gpu.shared`).
GPU_RESOURCE_PREFIXES = ("nvidia.com/gpu", "nvidia.com/mig-")


class DecodeError(ValueError):
    """The bytes are not a ListPodResourcesResponse."""


@dataclass(frozen=True)
class PodAllocation:
    namespace: str
    name: str
    #: Container name -> the GPU device ids it was allocated (in the order given).
    containers: Mapping[str, tuple[str, ...]]
    #: Whether a container has devices from Dynamic Resource Allocation (named by claim).
    dynamic_resources: bool = False


@dataclass(frozen=True)
class PodList:
    """One answer of the kubelet's."""

    pods: Mapping[tuple[str, str], PodAllocation]
    #: What the decoder's bounds left out, by what ("pods", "containers", "devices", "names").
    cut: Mapping[str, int] = field(default_factory=dict)


# -- protobuf wire format -------------------------------------------------------------------

_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5


def _varint(buf: bytes, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if at >= len(buf):
            raise DecodeError("truncated varint")
        byte = buf[at]
        at += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, at
        shift += 7
        if shift >= 64:
            raise DecodeError("varint longer than 10 bytes")


def _fields(buf: bytes) -> list[tuple[int, int, Any]]:
    """(field number, wire type, value) of each field: an int, or the bytes of a LEN field."""
    out: list[tuple[int, int, Any]] = []
    at = 0
    while at < len(buf):
        key, at = _varint(buf, at)
        number, wire = key >> 3, key & 7
        if number == 0:
            raise DecodeError("field number 0")
        if wire == _VARINT:
            value, at = _varint(buf, at)
        elif wire == _I64:
            if at + 8 > len(buf):
                raise DecodeError("truncated fixed64")
            value, at = None, at + 8
        elif wire == _I32:
            if at + 4 > len(buf):
                raise DecodeError("truncated fixed32")
            value, at = None, at + 4
        elif wire == _LEN:
            size, at = _varint(buf, at)
            if at + size > len(buf):
                raise DecodeError("length past the end")
            value, at = buf[at:at + size], at + size
        else:  # groups (3, 4) are not in proto3; 6 and 7 are not wire types
            raise DecodeError(f"wire type {wire}")
        out.append((number, wire, value))
    return out


def _text(value: Any, cut: dict[str, int]) -> Optional[str]:
    if not isinstance(value, bytes):
        raise DecodeError("a string field that is not length-delimited")
    if len(value) > MAX_NAME_BYTES:
        cut["names"] = cut.get("names", 0) + 1
        return None
    return value.decode("utf-8", "replace")


def _message(wire: int, value: Any, what: str) -> bytes:
    """The bytes of a field that must hold a message (`what`, for DecodeError)."""
    if wire != _LEN:
        raise DecodeError(f"{what} is not a message")
    return value  # type: ignore[no-any-return]


def _room(cut: dict[str, int], what: str, kept: int, limit: int) -> bool:
    """Whether one more of `what` may be kept after `kept` of them: under `limit`; where it may
    not, it is counted in `cut`."""
    if kept < limit:
        return True
    cut[what] = cut.get(what, 0) + 1
    return False


def decode_list_response(buf: bytes) -> PodList:
    """A ListPodResourcesResponse's pods, their containers and GPU devices; DecodeError where the
    bytes are not protobuf of that shape."""
    cut: dict[str, int] = {}
    pods: dict[tuple[str, str], PodAllocation] = {}
    for number, wire, value in _fields(bytes(buf)):
        if number != 1:
            continue
        message = _message(wire, value, "pod_resources")
        if _room(cut, "pods", len(pods), MAX_PODS):
            pod = _pod(message, cut)
            if pod is not None:
                pods[(pod.namespace, pod.name)] = pod
    return PodList(pods=pods, cut=cut)


def _pod(buf: bytes, cut: dict[str, int]) -> Optional[PodAllocation]:
    name = namespace = None
    containers: dict[str, tuple[str, ...]] = {}
    dynamic = False
    for number, wire, value in _fields(buf):
        if number == 1:
            name = _text(value, cut)
        elif number == 2:
            namespace = _text(value, cut)
        elif number == 3:
            message = _message(wire, value, "containers")
            if _room(cut, "containers", len(containers), MAX_CONTAINERS):
                container = _container(message, cut)
                if container is not None:
                    containers[container[0]] = container[1]
                    dynamic = dynamic or container[2]
    if not name or not namespace:
        return None
    return PodAllocation(namespace=namespace, name=name, containers=containers,
                         dynamic_resources=dynamic)


def _container(buf: bytes, cut: dict[str, int]
               ) -> Optional[tuple[str, tuple[str, ...], bool]]:
    name = None
    devices: list[str] = []
    dynamic = False
    for number, wire, value in _fields(buf):
        if number == 1:
            name = _text(value, cut)
        elif number == 5:  # dynamic_resources
            dynamic = True
        elif number == 2:
            resource = None
            ids: list[str] = []
            for n, _wire, v in _fields(_message(wire, value, "devices")):
                if n == 1:
                    resource = _text(v, cut)
                elif n == 2:
                    device = _text(v, cut)
                    if device is not None:
                        ids.append(device)
            if resource is None or not resource.startswith(GPU_RESOURCE_PREFIXES):
                continue
            for device in ids:
                if not _room(cut, "devices", len(devices), MAX_DEVICES):
                    break
                devices.append(device)
    if not name:
        return None
    return name, tuple(devices), dynamic


# -- the call ------------------------------------------------------------------------------

class Unavailable(RuntimeError):
    """The kubelet could not be asked: no socket, no grpcio, or the call failed."""


def grpc_missing() -> Optional[str]:
    """Why grpcio cannot be used, or None when it can."""
    try:
        import grpc  # noqa: F401
    except ImportError as e:
        return f"grpcio is not installed (pip install 'gpuwatch[kubernetes]'): {e}"
    return None


def is_socket(path: str) -> bool:
    try:
        return stat.S_ISSOCK(os.stat(path).st_mode)
    except OSError:
        return False


class PodResourcesClient:
    """Asks the kubelet at `socket_path` for its pods. One channel, made at the first call and
    made again after a failure; each call has its deadline (`timeout`)."""

    def __init__(self, socket_path: str = DEFAULT_SOCKET, timeout: float = 2.0) -> None:
        self.socket_path = socket_path
        self.timeout = timeout
        self._channel: Any = None
        self._call: Any = None

    def list(self) -> PodList:
        if not is_socket(self.socket_path):
            raise Unavailable(f"no socket at {self.socket_path}")
        missing = grpc_missing()
        if missing is not None:
            raise Unavailable(missing)
        import grpc

        if self._call is None:
            self._channel = grpc.insecure_channel(
                f"unix:{self.socket_path}",
                options=[("grpc.max_receive_message_length", MAX_ANSWER_BYTES),
                         ("grpc.max_send_message_length", 1024),
                         ("grpc.enable_http_proxy", 0)])
            self._call = self._channel.unary_unary(
                METHOD, request_serializer=lambda _request: b"",
                response_deserializer=decode_list_response)
        try:
            answer: PodList = self._call(None, timeout=self.timeout)
        except grpc.RpcError as e:
            self.close()
            code = e.code() if callable(getattr(e, "code", None)) else None
            details = e.details() if callable(getattr(e, "details", None)) else None
            name = getattr(code, "name", None) or "error"
            raise Unavailable(f"{METHOD} on {self.socket_path}: {name}"
                              + (f" ({str(details)[:200]})" if details else "")) from None
        except DecodeError as e:  # grpc wraps a deserializer's error in RpcError; in case not
            self.close()
            raise Unavailable(f"{METHOD} on {self.socket_path}: bad answer: {e}") from None
        return answer

    def close(self) -> None:
        channel, self._channel, self._call = self._channel, None, None
        if channel is not None:
            # Closing a broken channel must not raise.
            with contextlib.suppress(Exception):
                channel.close()
