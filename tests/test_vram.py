from types import SimpleNamespace

import pynvml
import pytest
import torch

from qmigrate.monitor import vram
from qmigrate.monitor.vram import GpuMemory, NvmlUnavailable, VramPoller, torch_device_uuid

GiB = 1 << 30


def _real_nvml_works() -> bool:
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return False
    pynvml.nvmlShutdown()
    return True


class FakeNvml:
    """Two GPUs; NVML index order differs from the CUDA order a worker sees."""

    def __init__(self, monkeypatch):
        self.gpus = [
            dict(uuid=b"GPU-aaaa-0000", name="NVIDIA H200", total=141 * GiB, used=10 * GiB, util=37),
            dict(uuid="GPU-bbbb-1111", name=b"NVIDIA H100 80GB HBM3", total=80 * GiB, used=79 * GiB, util=99),
        ]
        self.lost: set[int] = set()
        self.util_fails: set[int] = set()
        self.count_fails = False
        self.num_inits = self.num_shutdowns = 0
        for fn in ["nvmlInit", "nvmlShutdown", "nvmlDeviceGetCount", "nvmlDeviceGetHandleByIndex",
                   "nvmlDeviceGetUUID", "nvmlDeviceGetName", "nvmlDeviceGetMemoryInfo",
                   "nvmlDeviceGetUtilizationRates"]:
            monkeypatch.setattr(pynvml, fn, getattr(self, fn))

    def nvmlInit(self):
        self.num_inits += 1

    def nvmlShutdown(self):
        self.num_shutdowns += 1

    def nvmlDeviceGetCount(self):
        if self.count_fails:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_UNKNOWN)
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index):
        return ("handle", index)

    def _gpu(self, handle):
        return self.gpus[handle[1]]

    def nvmlDeviceGetUUID(self, handle):
        return self._gpu(handle)["uuid"]

    def nvmlDeviceGetName(self, handle):
        return self._gpu(handle)["name"]

    def nvmlDeviceGetMemoryInfo(self, handle):
        if handle[1] in self.lost:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
        g = self._gpu(handle)
        return SimpleNamespace(total=g["total"], used=g["used"], free=g["total"] - g["used"])

    def nvmlDeviceGetUtilizationRates(self, handle):
        if handle[1] in self.util_fails:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return SimpleNamespace(gpu=self._gpu(handle)["util"], memory=0)


@pytest.fixture
def fake(monkeypatch):
    return FakeNvml(monkeypatch)


def test_poll_reports_every_gpu(fake):
    with VramPoller() as poller:
        gpus = poller.poll()
    assert gpus == [
        GpuMemory(index=0, uuid="GPU-aaaa-0000", name="NVIDIA H200", total=141 * GiB,
                  used=10 * GiB, free=131 * GiB, util_percent=37),
        GpuMemory(index=1, uuid="GPU-bbbb-1111", name="NVIDIA H100 80GB HBM3", total=80 * GiB,
                  used=79 * GiB, free=1 * GiB, util_percent=99),
    ]
    assert (fake.num_inits, fake.num_shutdowns) == (1, 1)


def test_gpu_memory_is_frozen(fake):
    poller = VramPoller()
    gpu = poller.poll()[0]
    with pytest.raises(AttributeError):
        gpu.used = 0
    poller.close()
    poller.close()
    assert fake.num_shutdowns == 1


def test_worker_device_maps_by_uuid(fake, monkeypatch):
    # CUDA_VISIBLE_DEVICES=1 makes NVML's GPU 1 the worker's cuda:0; NVML still calls it index 1
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: SimpleNamespace(uuid="bbbb-1111"))
    uuid = torch_device_uuid(0)
    assert uuid == "GPU-bbbb-1111"
    with VramPoller() as poller:
        gpu = poller.poll_by_uuid()[uuid]
    assert (gpu.index, gpu.free) == (1, 1 * GiB)


def test_per_gpu_errors_do_not_crash(fake, caplog):
    fake.lost.add(0)
    fake.util_fails.add(1)
    with VramPoller() as poller:
        first = poller.poll()
        second = poller.poll()
        assert [(g.uuid, g.util_percent) for g in first] == [("GPU-bbbb-1111", -1)]
        assert second == first
        assert sum("GPU 0" in r.getMessage() for r in caplog.records) == 1
        fake.lost.clear()
        assert [g.index for g in poller.poll()] == [0, 1]
        fake.count_fails = True
        assert poller.poll() == []


def test_init_failure_is_one_clear_line(monkeypatch):
    def fail():
        raise pynvml.NVMLError(pynvml.NVML_ERROR_DRIVER_NOT_LOADED)

    monkeypatch.setattr(pynvml, "nvmlInit", fail)
    with pytest.raises(NvmlUnavailable, match="NVML unavailable: Driver Not Loaded"):
        VramPoller()


def test_missing_package_is_reported(monkeypatch):
    monkeypatch.setattr(vram, "pynvml", None)
    with pytest.raises(NvmlUnavailable, match="nvidia-ml-py"):
        VramPoller()


@pytest.mark.skipif(_real_nvml_works(), reason="NVML works on this machine")
def test_real_nvml_missing_raises_unavailable():
    with pytest.raises(NvmlUnavailable) as info:
        VramPoller()
    message = str(info.value)
    assert message.startswith("NVML unavailable: ")
    assert "\n" not in message and len(message) > len("NVML unavailable: ") + 5
    assert isinstance(info.value, RuntimeError)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available")
def test_torch_device_uuid_none_without_cuda():
    assert torch_device_uuid(0) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_real_gpu_uuid_matches_nvml():
    with VramPoller() as poller:
        by_uuid = poller.poll_by_uuid()
    for index in range(torch.cuda.device_count()):
        gpu = by_uuid[torch_device_uuid(index)]
        assert gpu.total > 0 and 0 <= gpu.free <= gpu.total


def test_a_process_memory_on_its_gpu_as_nvml_reports_it(monkeypatch):
    from qmigrate.monitor.vram import ProcessMemory
    procs = [SimpleNamespace(pid=11, usedGpuMemory=3 * GiB), SimpleNamespace(pid=42, usedGpuMemory=70 * GiB)]
    failing = {"by_uuid": False, "procs": False}

    def by_uuid(uuid):
        if failing["by_uuid"] or uuid != "GPU-aaaa":
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)
        return "handle"

    def running(handle):
        if failing["procs"]:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return procs
    monkeypatch.setattr(pynvml, "nvmlInit", lambda: None)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetHandleByUUID", by_uuid)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetComputeRunningProcesses", running)
    assert ProcessMemory("GPU-aaaa", 42).held_bytes() == 70 * GiB
    assert ProcessMemory("GPU-aaaa", 7).held_bytes() is None       # not listed: a PID namespace, say
    assert ProcessMemory("GPU-zzzz", 42).held_bytes() is None      # no such GPU
    procs[1] = SimpleNamespace(pid=42, usedGpuMemory=None)          # the driver does not say
    assert ProcessMemory("GPU-aaaa", 42).held_bytes() is None
    failing["procs"] = True
    assert ProcessMemory("GPU-aaaa", 11).held_bytes() is None
