"""NVML's return codes (nvmlReturn_t), numbered as pynvml's NVML_ERROR_* constants and the
library's nvml.h number them: one table for whatever names a code without the bindings loaded
(`gpuwatch doctor`'s advice per code, the fake driver's failures). Imports nothing of gpuwatch."""

from __future__ import annotations

SUCCESS = 0
UNINITIALIZED = 1
INVALID_ARGUMENT = 2
NOT_SUPPORTED = 3
NO_PERMISSION = 4
ALREADY_INITIALIZED = 5
NOT_FOUND = 6
INSUFFICIENT_SIZE = 7
INSUFFICIENT_POWER = 8
DRIVER_NOT_LOADED = 9
TIMEOUT = 10
IRQ_ISSUE = 11
LIBRARY_NOT_FOUND = 12
FUNCTION_NOT_FOUND = 13
CORRUPTED_INFOROM = 14
GPU_IS_LOST = 15
RESET_REQUIRED = 16
OPERATING_SYSTEM = 17
LIB_RM_VERSION_MISMATCH = 18
IN_USE = 19
MEMORY = 20
NO_DATA = 21
VGPU_ECC_NOT_SUPPORTED = 22
INSUFFICIENT_RESOURCES = 23
FREQ_NOT_SUPPORTED = 24
ARGUMENT_VERSION_MISMATCH = 25
DEPRECATED = 26
NOT_READY = 27
GPU_NOT_FOUND = 28
INVALID_STATE = 29
UNKNOWN = 999
