#!/usr/bin/env python3
"""llama.cpp's decoding threads against the CPUs a replica really has: a container's CPU limit,
and replicas that share a machine.

A container sees every core of its node whatever its CPU limit (CFS quota); an engine that
sized its threads from the visible cores (hotloop-serve before ``engine/cpus.py``) then ran more
threads than the quota, and llama.cpp's threads, which wait for each other at every graph node,
spent the quota early in each period and all stalled until the next one. Rows, each the engine's
decode tokens/s at 1 and 8 sessions (greedy, 64-token replies, prompts prefilled first, median
of ``--repeats``), every configuration in its own process:

1. no limit, every core (the baseline);
2. under a CPU quota of ``--quota`` cores (a cgroup the bench creates; needs root and a
   writable cgroup v1 ``cpu`` controller or a cgroup v2 hierarchy with the ``cpu`` controller,
   skipped with the reason otherwise), alternating: threads = every visible core (the old
   default) and threads = ``cpu_budget()`` (the default now: the quota's whole cores);
3. two engines side by side, no limit (two replicas on one machine): each with every core
   (the default, unless ``engine.threads`` is set) and each with half of them.

Run as root: ``.venv/bin/python bench/threads.py [--quota 1] [--repeats 3] [--json bench/results/threads.json]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

TOKENS = 64
WIDTHS = (1, 8)


def measure(threads: int, repeats: int) -> dict[int, float]:
    """In this process: the engine's decode rate at each width, median of ``repeats``."""
    from engine import fixed_run

    from hotloop_serve.engine import Engine, EngineOptions, SamplingSettings
    from hotloop_serve.serve.model_source import embedded_model_path

    greedy = SamplingSettings(temperature=0, sample_len=TOKENS, repeat_penalty=1.0)
    rates: dict[int, float] = {}
    with Engine(str(embedded_model_path(progress=False)), EngineOptions(threads=threads, context_tokens=8192)) as e:
        for n in WIDTHS:
            rates[n] = statistics.median(fixed_run(e, n, TOKENS, greedy, f"t{r}-")[0] for r in range(repeats))
    return rates


def child(threads: int, repeats: int, tasks: Path | None = None) -> subprocess.Popen[str]:
    """A process that joins the cgroup ``tasks`` (if any) first, then measures."""
    args = [sys.executable, __file__, "--child", str(threads), "--repeats", str(repeats)]
    if tasks is not None:
        args += ["--tasks", str(tasks)]
    return subprocess.Popen(args, stdout=subprocess.PIPE, text=True)


def result(p: subprocess.Popen[str]) -> dict[int, float]:
    out, _ = p.communicate()
    if p.returncode != 0:
        raise RuntimeError(f"measuring child failed with exit status {p.returncode}")
    return {int(k): v for k, v in json.loads(out.strip().splitlines()[-1]).items()}


@contextmanager
def quota_group(cores: float) -> Iterator[Path]:
    """A cgroup limited to ``cores`` cores' worth of time per 100 ms; yields its tasks file."""
    name = f"hotloop-bench-{uuid.uuid4().hex[:8]}"
    v1 = Path("/sys/fs/cgroup/cpu")
    v2 = Path("/sys/fs/cgroup")
    if (v1 / "cpu.cfs_quota_us").exists():
        group = v1 / name
        group.mkdir()
        (group / "cpu.cfs_period_us").write_text("100000")
        (group / "cpu.cfs_quota_us").write_text(str(int(cores * 100000)))
        tasks = group / "cgroup.procs"
    elif "cpu" in (v2 / "cgroup.subtree_control").read_text().split():
        group = v2 / name
        group.mkdir()
        (group / "cpu.max").write_text(f"{int(cores * 100000)} 100000")
        tasks = group / "cgroup.procs"
    else:
        raise PermissionError("no cgroup v1 cpu controller, and cgroup v2 does not delegate cpu")
    try:
        yield tasks
    finally:
        group.rmdir()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quota", type=float, default=1.0, help="cores of the simulated CPU limit")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2, help="alternating rounds under the quota")
    p.add_argument("--json", type=Path, default=Path(__file__).parent / "results" / "threads.json")
    p.add_argument("--child", type=int, help=argparse.SUPPRESS)
    p.add_argument("--tasks", type=Path, help=argparse.SUPPRESS)
    ns = p.parse_args()
    if ns.child is not None:
        if ns.tasks is not None:
            ns.tasks.write_text(str(os.getpid()))
        print(json.dumps(measure(ns.child, ns.repeats)))
        return 0

    from hotloop_serve.engine.cpus import cpu_budget

    cores = len(os.sched_getaffinity(0))
    rows: list[dict[str, Any]] = []

    def row(name: str, threads: int, rates: dict[int, float], base: dict[int, float] | None) -> None:
        ratio = {n: rates[n] / base[n] for n in WIDTHS} if base else None
        rows.append({"row": name, "threads": threads, "tok_s": rates, "vs_baseline": ratio})
        cells = " | ".join(f"{rates[n]:6.1f}" + (f" ({ratio[n]:.2f}x)" if ratio else "") for n in WIDTHS)
        print(f"| {name} | {threads} | {cells} |", flush=True)

    print(f"{cores} cores, {TOKENS}-token replies, median of {ns.repeats}; tok/s at 1 / 8 sessions\n")
    print("| row | threads | 1 session | 8 sessions |\n|---|---:|---:|---:|")
    base = result(child(cores, ns.repeats))
    row("1. no limit, every core (baseline)", cores, base, None)

    try:
        with quota_group(ns.quota) as tasks:
            fitted = max(1, min(cores, int(ns.quota)))
            for r in range(ns.rounds):
                old = result(child(cores, ns.repeats, tasks))
                row(f"2. {ns.quota:g}-core limit, every visible core (before), round {r + 1}", cores, old, base)
                new = result(child(0, ns.repeats, tasks))
                row(f"2. {ns.quota:g}-core limit, cpu_budget() (now), round {r + 1}", fitted, new, base)
                rows[-1]["vs_before"] = {n: new[n] / old[n] for n in WIDTHS}
    except (OSError, PermissionError) as e:
        print(f"| 2. under a CPU limit: skipped ({e}) | | | |")

    half = max(1, cores // 2)
    for threads in (cores, half):
        pair = [child(threads, ns.repeats), child(threads, ns.repeats)]
        rates = [result(c) for c in pair]
        total = {n: rates[0][n] + rates[1][n] for n in WIDTHS}
        row(f"3. two engines side by side, {threads} threads each (sum of both)", threads, total, base)

    print(f"\nthis process: {cpu_budget().describe()}")
    if ns.json:
        ns.json.write_text(json.dumps({"cores": cores, "quota": ns.quota, "rows": rows}, indent=1))
        print(f"wrote {ns.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
