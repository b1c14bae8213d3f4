"""Per-GPU memory and utilisation from NVML, keyed by GPU UUID."""

from __future__ import annotations

import logging
from dataclasses import dataclass

log = logging.getLogger(__name__)

try:
    import pynvml
except ImportError:  # pragma: no cover -- nvidia-ml-py is a declared dependency
    pynvml = None


class NvmlUnavailable(RuntimeError):
    pass


@dataclass(slots=True, frozen=True)
class GpuMemory:
    index: int  # NVML index: ignores CUDA_VISIBLE_DEVICES, so match workers by uuid
    uuid: str
    name: str
    total: int  # bytes
    used: int
    free: int
    util_percent: int  # -1 when NVML cannot say


def _text(value: str | bytes) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else value


class VramPoller:
    def __init__(self) -> None:
        if pynvml is None:
            raise NvmlUnavailable("NVML unavailable: the nvidia-ml-py package (pynvml) is not installed")
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            raise NvmlUnavailable(
                f"NVML unavailable: {exc} (no NVIDIA driver or libnvidia-ml on this machine?)"
            ) from None
        self._is_open = True
        self._failed: set[int] = set()

    def poll(self) -> list[GpuMemory]:
        if not self._is_open:
            raise NvmlUnavailable("NVML unavailable: poller is closed")
        try:
            num_gpus = pynvml.nvmlDeviceGetCount()
        except pynvml.NVMLError as exc:
            log.warning("NVML device count failed: %s", exc)
            return []
        gpus = []
        for index in range(num_gpus):
            gpu = self._poll_one(index)
            if gpu is not None:
                gpus.append(gpu)
        return gpus

    def poll_by_uuid(self) -> dict[str, GpuMemory]:
        return {gpu.uuid: gpu for gpu in self.poll()}

    def _poll_one(self, index: int) -> GpuMemory | None:
        try:
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            uuid = _text(pynvml.nvmlDeviceGetUUID(handle))
            mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
        except pynvml.NVMLError as exc:
            # log once per GPU, not once per poll: a lost GPU stays lost
            if index not in self._failed:
                log.warning("NVML query of GPU %d failed, skipping it: %s", index, exc)
                self._failed.add(index)
            return None
        self._failed.discard(index)
        try:
            name = _text(pynvml.nvmlDeviceGetName(handle))
        except pynvml.NVMLError:
            name = "unknown"
        try:
            util = int(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)
        except pynvml.NVMLError:
            util = -1
        return GpuMemory(index=index, uuid=uuid, name=name, total=int(mem.total),
                         used=int(mem.used), free=int(mem.free), util_percent=util)

    def close(self) -> None:
        if self._is_open:
            self._is_open = False
            try:
                pynvml.nvmlShutdown()
            except pynvml.NVMLError as exc:
                log.debug("nvmlShutdown failed: %s", exc)

    def __enter__(self) -> VramPoller:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


class ProcessMemory:
    """What NVML says one process holds on one GPU: its allocations and its CUDA context, which
    the process's own allocator does not count. None where NVML cannot say (no NVML, a driver
    that does not report per process, or a PID namespace that hides the host's PIDs)."""

    def __init__(self, gpu_uuid: str, pid: int) -> None:
        self.pid = pid
        self.handle = None
        if pynvml is None:
            return
        try:
            pynvml.nvmlInit()
            self.handle = pynvml.nvmlDeviceGetHandleByUUID(gpu_uuid)
        except pynvml.NVMLError as exc:
            log.info("no per-process GPU memory from NVML: %s", exc)

    def held_bytes(self) -> int | None:
        if self.handle is None:
            return None
        try:
            procs = pynvml.nvmlDeviceGetComputeRunningProcesses(self.handle)
        except pynvml.NVMLError:
            return None
        for proc in procs:
            used = getattr(proc, "usedGpuMemory", None)
            if proc.pid == self.pid and isinstance(used, int) and used >= 0:
                return used
        return None


def torch_device_uuid(index: int) -> str | None:
    """The UUID of CUDA device `index` as NVML prints it ("GPU-..."), or None without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    uuid = str(torch.cuda.get_device_properties(index).uuid)
    return uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}"
