"""Which processes a run keeps busy: samples /proc every 0.25 s while a command runs and prints,
per process (its title: roles set theirs), the CPU it used (cores, 1.0 = one core busy) over
the busiest second and on average.

    python docs/bench/cpu_busy.py [--match TEXT] -- COMMAND...
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

TICK = os.sysconf("SC_CLK_TCK")


def snapshot(match: str) -> dict[int, tuple[str, float]]:
    out = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                title = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if match in title:
            out[int(pid)] = (title[:90], (int(fields[11]) + int(fields[12])) / TICK)
    return out


def main() -> int:
    args = sys.argv[1:]
    match = ""
    if args[:1] == ["--match"]:
        match, args = args[1], args[2:]
    if args[:1] == ["--"]:
        args = args[1:]
    proc = subprocess.Popen(args)
    samples, first = [(time.monotonic(), snapshot(match))], None
    while proc.poll() is None:
        time.sleep(0.25)
        samples.append((time.monotonic(), snapshot(match)))
    busiest, total = {}, {}
    for k in range(4, len(samples)):   # one-second windows
        (t0, a), (t1, b) = samples[k - 4], samples[k]
        for pid, (title, cpu) in b.items():
            if pid in a:
                busiest[pid] = max(busiest.get(pid, (title, 0.0))[1], (cpu - a[pid][1]) / (t1 - t0)), title
                busiest[pid] = (title, busiest[pid][0])
    (t0, a), (t1, b) = samples[0], samples[-1]
    for pid, (title, cpu) in b.items():
        total[pid] = (cpu - a.get(pid, (title, cpu))[1]) / max(t1 - t0, 1e-9)
    rows = sorted(busiest.items(), key=lambda kv: -kv[1][1])[:10]
    print(f"busiest processes ({t1 - t0:.1f} s): cores in the busiest second / on average")
    for pid, (title, peak) in rows:
        print(f"  {peak:5.2f} {total.get(pid, 0.0):5.2f}  {title}")
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
