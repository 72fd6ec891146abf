#!/usr/bin/env python3
"""Affinity benchmark: Ray Serve's default router vs hotloop's session-affinity router.

Side by side in one run, the same server twice (2 replicas of the bundled Gemma model on this
machine), 16 sessions x 4 turns with a long history that no two sessions share (so only a
session's own cache can help): follow-up time to first token (median, p90), the share of
follow-up prompt tokens served from cache, aggregate tokens/s, and which replicas served.

Run: ``.venv/bin/python bench/affinity.py [--sessions 16] [--turns 4] [--quick]``; writes
``bench/results/affinity.{md,json}``. Reuses the workload and the server harness (harness.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import RESULTS, HotloopServer, SystemResult, percentile, run_system
from workload import WorkloadSpec, build_workload, describe


class RoutedServer(HotloopServer):
    """Two replicas; ``affinity`` switches the model's request router."""

    def __init__(self, key: str, affinity: bool, threads: int) -> None:
        super().__init__(key, 2, threads)
        self.config["models"][0]["routing"] = {"session_affinity": affinity}
        self.label = f"2 replicas, {'session-affinity router' if affinity else 'Ray default router'}"


def figures(result: SystemResult) -> dict[str, Any]:
    ok = [r for r in result.turns if r.error is None and r.ttft_s is not None]
    follow = sorted(r.ttft_s for r in ok if r.turn >= 2 and r.ttft_s is not None)
    owners = {r.session: r.reply.replica for r in ok if r.turn == 1}
    stuck = [r for r in ok if r.turn >= 2 and r.reply.replica == owners.get(r.session)]
    hits = [r for r in ok if r.turn >= 2 and (r.reply.cached_tokens or 0) > 0]
    n_follow = sum(1 for r in ok if r.turn >= 2)
    prompt = sum(r.reply.prompt_tokens or 0 for r in ok if r.turn >= 2)
    cached = sum(r.reply.cached_tokens or 0 for r in ok if r.turn >= 2)

    return {
        "system": result.label,
        "followup_ttft_median_s": percentile(follow, 50),
        "followup_ttft_p90_s": percentile(follow, 90),
        "followups_on_owner": len(stuck) / n_follow if n_follow else None,
        "followups_cache_hit": len(hits) / n_follow if n_follow else None,
        "followup_prompt_tokens_cached": cached / prompt if prompt else None,
        "aggregate_tok_s": sum(r.reply.tokens for r in ok) / result.wall_s if result.wall_s else None,
        "wall_s": result.wall_s,
        "errors": sum(1 for r in result.turns if r.error is not None),
    }


def table(rows: list[dict[str, Any]], workload: str) -> str:
    def f(x: Any, pct: bool = False) -> str:
        if x is None:
            return "-"
        return f"{x:.1%}" if pct else f"{x:.2f}"

    lines = [
        f"Workload: {workload}; {len(os.sched_getaffinity(0))} cores, 2 replicas on this machine.",
        "",
        "| router | follow-up TTFT median (s) | p90 (s) | follow-ups on owner | follow-ups hitting cache "
        "| follow-up prompt tokens cached | aggregate tok/s | wall (s) | errors |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['system']} | {f(r['followup_ttft_median_s'])} | {f(r['followup_ttft_p90_s'])} "
            f"| {f(r['followups_on_owner'], True)} | {f(r['followups_cache_hit'], True)} "
            f"| {f(r['followup_prompt_tokens_cached'], True)} | {f(r['aggregate_tok_s'])} | {f(r['wall_s'])} "
            f"| {r['errors']} |"
        )
    if len(rows) == 2 and rows[0]["followup_ttft_median_s"] and rows[1]["followup_ttft_median_s"]:
        speed = rows[0]["followup_ttft_median_s"] / rows[1]["followup_ttft_median_s"]
        lines += ["", f"Follow-up TTFT median, default / affinity: {speed:.1f}x"]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sessions", type=int, default=16)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--sample-len", type=int, default=32)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--quick", action="store_true", help="4 sessions x 2 turns, short history (smoke test)")
    ns = ap.parse_args()
    if ns.quick:
        spec = WorkloadSpec(sessions=4, turns=2, sample_len=8, first_turn_words=150)
    else:
        spec = WorkloadSpec(sessions=ns.sessions, turns=ns.turns, sample_len=ns.sample_len)
    workload = build_workload(spec)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "logs").mkdir(exist_ok=True)
    rows = []
    for key, affinity in (("default", False), ("affinity", True)):
        result = run_system(RoutedServer(key, affinity, ns.threads), workload, RESULTS / "logs", "affinity")
        rows.append(figures(result))
        print(json.dumps(rows[-1], default=str), flush=True)
    report = table(rows, describe(workload))
    print("\n" + report)
    suffix = "_quick" if ns.quick else ""
    (RESULTS / f"affinity{suffix}.md").write_text(report + "\n")
    (RESULTS / f"affinity{suffix}.json").write_text(json.dumps(rows, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
