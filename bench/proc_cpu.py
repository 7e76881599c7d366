"""CPU seconds of a group of processes (user + system, their live children and reaped children included), read
before and after a measured run: where the machine's cores went (services, Postgres, NATS), per event or turn."""

from __future__ import annotations

import psutil


class CpuGroup:
    def __init__(self, pids: list[int], *, children: bool = True) -> None:
        self.procs = [psutil.Process(p) for p in pids]
        # off for a process whose children are not its own work (a bench process is the parent of its stack)
        self.children = children

    def seconds(self) -> float:
        total = 0.0
        for p in self.procs:
            try:
                t = p.cpu_times()
                total += t.user + t.system
                if not self.children:
                    continue
                total += t.children_user + t.children_system
                kids = p.children(recursive=True)
            except psutil.NoSuchProcess:
                continue
            for c in kids:
                try:
                    ct = c.cpu_times()
                    total += ct.user + ct.system
                except psutil.NoSuchProcess:
                    pass  # exited in between: its time shows up in the parent's children_* once reaped
        return total


def snapshot(groups: dict[str, list[int]]) -> dict[str, float]:
    return {name: CpuGroup(pids).seconds() for name, pids in groups.items()}


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before[k] for k in before}
