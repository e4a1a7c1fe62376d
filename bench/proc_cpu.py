"""The CPU time a server and its clients take, sampled from /proc (Linux): how much of the
machine's cores each had during a window of wall time. A load generator that is itself busy
takes cores from the server it measures on a small machine; this shows by how much."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far (0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / TICK  # utime, stime (fields 14, 15 of stat)


def descendants(root: int) -> set[int]:
    """Every live process below `root`."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(stat.parent.name))
    found, todo = set(), [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


class CpuSampler:
    """Samples, every `every` seconds, the CPU seconds of the `server` process and of the clients:
    this process and every process below it but the server (a load generator it started)."""

    def __init__(self, server: int, every: float = 0.5):
        self.server, self.every, self.samples = server, every, []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        me = os.getpid()
        while not self.stop.is_set():
            clients = {me} | descendants(me) - {self.server} - descendants(self.server)
            self.samples.append((time.time(), cpu_seconds(self.server), sum(cpu_seconds(p) for p in clients)))
            self.stop.wait(self.every)

    def __enter__(self) -> CpuSampler:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()

    def share(self, start: float, end: float) -> dict:
        """Cores the server and the clients used on average between two time.time() instants (from
        the samples nearest inside them; None when fewer than two fall inside)."""
        inside = [s for s in self.samples if start <= s[0] <= end]
        if len(inside) < 2:
            return {"server_cores": None, "client_cores": None}
        (t0, s0, c0), (t1, s1, c1) = inside[0], inside[-1]
        return {"server_cores": (s1 - s0) / (t1 - t0), "client_cores": max(c1 - c0, 0.0) / (t1 - t0)}
