"""A stream that waits on the device for a word of host memory: the GPU worker's sampling
queued behind masks another process has not written yet (engine/grammar.py says why).

CUDA's stream memory operations (`cuStreamWaitValue32`): the stream stops at the wait until a
32-bit word of host memory, mapped for the device, reaches a value (a cyclic comparison:
`(int32)(word - value) >= 0`, so a counter may wrap), and what is queued after it runs once it
does. The worker queues the wait, the copy of the masks and the sampling, and goes on; the
matchers' process writes the masks, then the word. Called through the driver's library with
ctypes (torch does not expose these calls); on a machine whose driver refuses them, `Waits`
cannot be made and the worker waits for the masks itself, as on the CPU.

The ordering it relies on (the masks written before the word, seen in that order by the
device) is the x86-64 store order; elsewhere `Waits.make` says no. `DeviceMasks` keeps the
regions shared with the mask processes, the fills' numbers and the watch over the processes.
"""

from __future__ import annotations

import ctypes
import logging
import platform
import threading
import time

log = logging.getLogger(__name__)

CU_MEMHOSTREGISTER_PORTABLE = 0x01
CU_MEMHOSTREGISTER_DEVICEMAP = 0x02
CU_STREAM_WAIT_VALUE_GEQ = 0x0
WATCH_EVERY_S = 0.05   # how often a worker whose device waits for masks checks their processes


class DeviceWaitError(RuntimeError):
    pass


class Waits:
    """The driver's calls for waits on host words: `register` maps host memory for the device,
    `wait` queues a wait on the current stream."""

    def __init__(self, lib) -> None:
        self.lib = lib
        self._wait = _symbol(lib, "cuStreamWaitValue32_v2", "cuStreamWaitValue32")
        self._register = _symbol(lib, "cuMemHostRegister_v2", "cuMemHostRegister")
        self._unregister = _symbol(lib, "cuMemHostUnregister")
        self._pointer = _symbol(lib, "cuMemHostGetDevicePointer_v2", "cuMemHostGetDevicePointer")
        self._wait.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
        self._register.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
        self._unregister.argtypes = [ctypes.c_void_p]
        self._pointer.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p, ctypes.c_uint]

    @classmethod
    def make(cls, device) -> "Waits | None":
        """The calls for `device`, or None where the worker must wait for masks itself (not a
        CUDA device, not x86-64, no driver library, or it refuses a wait: logged)."""
        if getattr(device, "type", None) != "cuda":
            return None
        if platform.machine() not in ("x86_64", "AMD64"):
            log.info("masks waited for on the host: device-side waits are used on x86-64 only")
            return None
        try:
            waits = cls(ctypes.CDLL("libcuda.so.1"))
            waits.check(device)
        except (OSError, AttributeError, DeviceWaitError) as exc:
            log.warning("masks waited for on the host: the driver refuses device-side waits (%s)", exc)
            return None
        return waits

    def register(self, address: int, size: int) -> int:
        """Map host memory [address, address + size) (page-aligned) for the device; its
        address there."""
        _ok(self._register(address, size, CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP),
            "cuMemHostRegister")
        pointer = ctypes.c_uint64()
        _ok(self._pointer(ctypes.byref(pointer), address, 0), "cuMemHostGetDevicePointer")
        return pointer.value

    def unregister(self, address: int) -> None:
        self._unregister(address)

    def wait(self, device_address: int, value: int, stream: int | None = None) -> None:
        """Queue on `stream` (a CUstream handle; the current stream by default): wait until the
        word reaches `value`."""
        if stream is None:
            import torch
            stream = torch.cuda.current_stream().cuda_stream
        _ok(self._wait(stream, device_address, value & 0xFFFFFFFF, CU_STREAM_WAIT_VALUE_GEQ), "cuStreamWaitValue32")

    def check(self, device) -> None:
        """One wait on a word already past its value, on a stream of its own: raises where the
        driver refuses the call."""
        import mmap

        import numpy as np
        import torch
        page = mmap.mmap(-1, mmap.PAGESIZE)
        word = np.frombuffer(page, dtype=np.uint32)
        word[0] = 1
        address = word.ctypes.data
        device_address = self.register(address, mmap.PAGESIZE)
        try:
            stream = torch.cuda.Stream(device)
            self.wait(device_address, 1, stream.cuda_stream)
            stream.synchronize()
        finally:
            self.unregister(address)
            del word
            page.close()


class DeviceMasks:
    """Structured output's masks the device waits for (engine/grammar.py): each mask process's
    region of memory shared with it (hub/mask_shared.py), mapped for the device, made at the
    first fill (the mask's width is known then); the fills' numbers, which each process writes
    to its region's word once the masks are there; and a watch thread that releases the
    device from its waits if a process ends or stops answering (`failure` then says why,
    and the worker stops at its next call: `check`)."""

    def __init__(self, waits: Waits, rows: int, timeout_s: float, device) -> None:
        self.waits, self.rows, self.timeout_s, self.device = waits, rows, timeout_s, device
        self.processes: list = []
        self.regions: list | None = None   # (region, its word's device address) per process
        self.sources: list = []           # per region, per turn: its rows as a CPU tensor (copied from)
        self.number = 0
        self.issued = (0, 0.0)            # (the last fill's number, when it was asked)
        self.failure: str | None = None
        self.closing = threading.Event()

    def open(self, processes: list, width: int) -> bool:
        """Share a region with each process (MaskProcess.share) and map it; False where one
        could not (the host waits for masks from then on)."""
        import numpy as np
        import torch
        try:
            regions = [p.share(self.rows, width) for p in processes]
        except OSError as exc:   # no anonymous memory file here
            log.warning("structured output's masks are waited for on the host: no shared region (%s)", exc)
            return False
        if any(r is None for r in regions):
            log.warning("structured output's masks are waited for on the host: a process could not map "
                        "the shared region")
            return False
        registered = []
        try:
            for r in regions:
                registered.append((r, self.waits.register(r.address, r.size)))
        except DeviceWaitError as exc:   # e.g. more page-locked memory than the system allows
            for r, _ in registered:
                self.waits.unregister(r.address)
            log.warning("structured output's masks are waited for on the host: the driver does not map "
                        "the shared regions (%s)", exc)
            return False
        self.processes = processes
        self.regions = registered
        self.sources = [[torch.from_numpy(t.view(np.int32)) for t in r.turns] for r in regions]
        log.info("structured output's masks: written by %d process(es) to shared memory, waited for by the "
                 "device (steps of up to %d constrained rows)", len(regions), self.rows)
        threading.Thread(target=self._watch, name="masks-watch", daemon=True).start()
        return True

    def next(self) -> int:
        """The number of the next fill (the word its processes write)."""
        self.number = (self.number + 1) & 0xFFFFFFFF
        self.issued = (self.number, time.monotonic())
        return self.number

    def plan(self, runs: list[tuple[int, int]], turn: int, number: int) -> list:
        """Per process with rows (its (first, end) run of the step's rows, in `runs`): its word's
        device address, the fill's number, its region's turn, its run."""
        return [(word, number, self.sources[k][turn], first, end)
                for k, ((_, word), (first, end)) in enumerate(zip(self.regions, runs)) if end > first]

    def queue(self, plan: list, num_rows: int, width: int):
        """The plan's masks on the device [num_rows, width] (int32), copied from each region
        once the device has seen its word: queued, not waited for."""
        import torch
        self.check()
        bits = torch.empty(num_rows, width, dtype=torch.int32, device=self.device)
        for word, number, source, first, end in plan:
            self.waits.wait(word, number)
            bits[first:end].copy_(source[:end - first], non_blocking=True)
        return bits

    def check(self) -> None:
        if self.failure is not None:
            raise RuntimeError(self.failure)

    def _watch(self) -> None:
        while not self.closing.wait(WATCH_EVERY_S):
            number, asked = self.issued
            ended = [p.proc.returncode for p in self.processes if p.proc.poll() is not None]
            late = any(not reached(int(r.word[0]), number) for r, _ in self.regions) \
                and time.monotonic() - asked > self.timeout_s
            if ended or late:
                self.failure = (f"structured output's mask process has ended (exit code {ended[0]})" if ended else
                                f"structured output's mask process did not answer within {self.timeout_s:g} s")
                self._release()
                return

    def _release(self) -> None:
        """Every region's word at the last fill asked for: no wait on the device outlasts it."""
        for region, _ in self.regions:
            region.word[0] = self.issued[0]

    def close(self) -> None:
        self.closing.set()
        if self.regions is not None:
            self._release()
            if self.device.type == "cuda":
                import torch
                torch.cuda.synchronize(self.device)   # no copy from the regions in flight
            for region, _ in self.regions:
                self.waits.unregister(region.address)
            self.sources = []


def reached(word: int, value: int) -> bool:
    """The device's comparison: whether a word has reached `value` (cyclically, as it may wrap)."""
    return (word - value) & 0xFFFFFFFF < 1 << 31


def _symbol(lib, *names):
    for name in names:
        fn = getattr(lib, name, None)
        if fn is not None:
            fn.restype = ctypes.c_int
            return fn
    raise AttributeError(f"the driver has none of {', '.join(names)}")


def _ok(code: int, what: str) -> None:
    if code != 0:
        raise DeviceWaitError(f"{what} failed (CUresult {code})")
