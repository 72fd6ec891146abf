"""How many CPU threads llama.cpp should decode with: the cores this process may really use.

Why not ``os.cpu_count()`` or the CPU affinity alone: in a container with a CPU limit
(Kubernetes ``resources.limits.cpu``, ``docker --cpus``) the process still sees every core of
the node, but the kernel lets it run only ``quota / period`` cores' worth per period (CFS
bandwidth control). llama.cpp's threads wait for each other at every graph node, so with more
threads than the quota they spend the quota early in each period and then all stall until the
next one: under a 1-core quota, 2 threads decode slower than 1 (``bench/threads.py`` measures
it), and on a 64-core node under a 2-core limit it would be 64 threads in 2 cores' worth of time.

The engine knows nothing of Ray or Kubernetes: it reads the kernel's view (affinity and the
cgroup's quota, v1 or v2), the same one every container runtime sets.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CpuBudget", "cpu_budget"]

CGROUP_ROOT = Path("/sys/fs/cgroup")


@dataclass(frozen=True)
class CpuBudget:
    """The cores this process may use, and where each bound comes from (for the startup log)."""

    affinity: int
    """Cores in the process's CPU affinity mask (all of the machine's unless pinned)."""
    quota: float | None
    """Cores' worth of time per period the process's cgroup allows; None when unlimited."""

    @property
    def threads(self) -> int:
        """Decoding threads: the affinity, capped by the quota's whole cores (at least 1). A
        fractional remainder (a 2.5-core limit) is left to the rest of the process: its event
        loops, Ray's workers and the proxy share the same limit."""
        if self.quota is None:
            return self.affinity
        return max(1, min(self.affinity, math.floor(self.quota)))

    def describe(self) -> str:
        limit = "no CPU limit" if self.quota is None else f"a CPU limit of {self.quota:g} cores"
        return f"{self.threads} threads ({self.affinity} cores in the affinity mask, {limit})"


def cpu_budget(root: Path = CGROUP_ROOT, proc_cgroup: Path = Path("/proc/self/cgroup")) -> CpuBudget:
    """The process's CPU budget now. ``root`` and ``proc_cgroup`` are parameters for tests."""
    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows: no affinity masks
        affinity = os.cpu_count() or 1
    return CpuBudget(affinity=max(1, affinity), quota=_cgroup_quota(root, proc_cgroup))


def _cgroup_quota(root: Path, proc_cgroup: Path) -> float | None:
    """The tightest CPU quota on the way from the process's cgroup up to the root, in cores.

    A limit can sit on any ancestor (a Kubernetes pod's limit is on the pod's cgroup, above the
    container's), and inside a container the cgroup namespace usually shows its own cgroup as
    the root, so every directory from the process's own up to the mount point is read.
    """
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    quotas: list[float] = []
    for line in lines:
        hierarchy, controllers, path = [*line.split(":", 2), "", ""][:3]
        if hierarchy == "0" and controllers == "":  # cgroup v2: cpu.max = "<quota|max> <period>"
            quotas += _along(root, path, _v2_quota)
        elif "cpu" in controllers.split(","):  # cgroup v1: cpu.cfs_quota_us / cpu.cfs_period_us
            mount = next((root / c for c in (controllers, "cpu", "cpu,cpuacct") if (root / c).is_dir()), None)
            if mount is not None:
                quotas += _along(mount, path, _v1_quota)
    return min(quotas) if quotas else None


def _along(mount: Path, path: str, read: Callable[[Path], float | None]) -> list[float]:
    """``read`` applied to every directory from ``mount/path`` up to ``mount``."""
    found: list[float] = []
    d = mount / path.strip("/")
    while True:
        q = read(d)
        if q is not None:
            found.append(q)
        if d == mount or mount not in d.parents:
            return found
        d = d.parent


def _v2_quota(d: Path) -> float | None:
    try:
        quota, period = (d / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        return None


def _v1_quota(d: Path) -> float | None:
    try:
        quota = int((d / "cpu.cfs_quota_us").read_text())
        period = int((d / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None if quota <= 0 or period <= 0 else quota / period
