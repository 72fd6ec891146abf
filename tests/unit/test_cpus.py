"""The engine's decoding threads: the process's affinity, capped by its cgroup's CPU quota."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from hotloop_serve.config import Config
from hotloop_serve.engine.cpus import CpuBudget, cpu_budget
from hotloop_serve.serve.runner import oversubscribed_cores


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _hierarchy(tmp_path: Path, proc_cgroup: str, files: dict[str, str]) -> tuple[Path, Path]:
    """A fake cgroup mount under ``tmp_path/cg`` holding ``files``, and a /proc/self/cgroup."""
    proc = tmp_path / "proc_cgroup"
    proc.write_text(proc_cgroup)
    root = tmp_path / "cg"
    for name, text in files.items():
        _write(root / name, text)
    return root, proc


@pytest.mark.parametrize(
    ("affinity", "quota", "threads"),
    [(8, None, 8), (8, 2.0, 2), (8, 2.5, 2), (8, 0.5, 1), (2, 4.0, 2), (1, None, 1)],
)
def test_threads_are_the_affinity_capped_by_the_quotas_whole_cores(
    affinity: int, quota: float | None, threads: int
) -> None:
    budget = CpuBudget(affinity=affinity, quota=quota)
    assert budget.threads == threads
    assert budget.describe().startswith(f"{threads} threads ({affinity} cores in the affinity mask")


def test_cgroup_v2_the_tightest_limit_on_the_way_to_the_root(tmp_path: Path) -> None:
    """A Kubernetes pod's limit sits on the pod's cgroup, above the container's own."""
    root, proc = _hierarchy(
        tmp_path,
        "0::/kubepods/pod1/ctr\n",
        {
            "cpu.max": "max 100000\n",
            "kubepods/cpu.max": "max 100000\n",
            "kubepods/pod1/cpu.max": "200000 100000\n",
            "kubepods/pod1/ctr/cpu.max": "max 100000\n",
        },
    )
    budget = cpu_budget(root, proc)
    assert budget.quota == 2.0
    assert budget.threads == min(2, budget.affinity)


def test_cgroup_v2_namespace_root_and_no_limit(tmp_path: Path) -> None:
    root, proc = _hierarchy(tmp_path, "0::/\n", {"cpu.max": "150000 100000\n"})
    assert cpu_budget(root, proc).quota == 1.5
    _write(root / "cpu.max", "max 100000\n")
    assert cpu_budget(root, proc).quota is None


def test_cgroup_v1_cpu_controller(tmp_path: Path) -> None:
    root, proc = _hierarchy(
        tmp_path,
        "5:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n0::/\n",
        {
            "cpu,cpuacct/cpu.cfs_quota_us": "-1\n",
            "cpu,cpuacct/cpu.cfs_period_us": "100000\n",
            "cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "300000\n",
            "cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000\n",
        },
    )
    assert cpu_budget(root, proc).quota == 3.0
    _write(root / "cpu,cpuacct/docker/abc/cpu.cfs_quota_us", "-1\n")
    assert cpu_budget(root, proc).quota is None


def test_unreadable_or_missing_cgroup_files_mean_no_limit(tmp_path: Path) -> None:
    assert cpu_budget(tmp_path, tmp_path / "missing").quota is None
    proc = tmp_path / "proc_cgroup"
    proc.write_text("0::/a\ngarbage\n4:cpu:/x\n")
    _write(tmp_path / "a/cpu.max", "not numbers\n")
    budget = cpu_budget(tmp_path, proc)
    assert budget.quota is None
    assert budget.affinity == len(os.sched_getaffinity(0))


V1_CPU = Path("/sys/fs/cgroup/cpu")


@pytest.mark.skipif(
    not (V1_CPU / "cpu.cfs_quota_us").exists() or not os.access(V1_CPU, os.W_OK),
    reason="needs a writable cgroup v1 cpu controller (root on a cgroup v1 host)",
)
def test_a_real_cpu_quota_caps_the_threads() -> None:
    """A child process moved into a cgroup with a 1-core quota sees it (the kernel's own files)."""
    group = V1_CPU / f"hotloop-test-{uuid.uuid4().hex[:8]}"
    group.mkdir()
    try:
        (group / "cpu.cfs_period_us").write_text("100000")
        (group / "cpu.cfs_quota_us").write_text("100000")
        code = (
            "import os, sys\n"
            f"open('{group}/tasks', 'w').write(str(os.getpid()))\n"
            "from hotloop_serve.engine.cpus import cpu_budget\n"
            "b = cpu_budget(); print(b.quota, b.threads)\n"
        )
        out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
        assert out.stdout.split() == ["1.0", "1"]
    finally:
        group.rmdir()


def _config(*models: dict[str, object]) -> Config:
    return Config.model_validate({"models": [{"path": "/nonexistent.gguf", **m} for m in models]})


def test_a_local_server_warns_when_its_replicas_would_share_every_core() -> None:
    two = _config({"name": "a", "replicas": 2})
    warning = oversubscribed_cores(two, cores=8)
    assert warning is not None and "set engine.threads to 4" in warning and "each replica of a decodes" in warning
    scaling = _config({"name": "a"}, {"name": "b", "autoscaling": {"min_replicas": 1, "max_replicas": 3}})
    assert "set engine.threads to 2" in (oversubscribed_cores(scaling, cores=8) or "")
    assert "set engine.threads to 1" in (oversubscribed_cores(two, cores=1) or "")


def test_one_replica_or_explicit_threads_need_no_warning() -> None:
    assert oversubscribed_cores(_config({"name": "a"}), cores=8) is None
    pinned = _config({"name": "a", "replicas": 2, "engine": {"threads": 4}}, {"name": "b", "engine": {"threads": 2}})
    assert oversubscribed_cores(pinned, cores=8) is None
