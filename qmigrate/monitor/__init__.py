"""The VRAM monitor role: loop.py publishes what vram.py reads from NVML."""
