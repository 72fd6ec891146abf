"""`hotloop-serve status`: each model's replicas, their sessions by tier, and cache hit rates."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import typer


def hit_rate(stats: dict[str, Any]) -> float | None:
    """Share of prompt tokens not prefilled: found hot in KV or restored from RAM/disk."""
    prompt = int(stats.get("prompt_tokens", 0))
    if not prompt:
        return None
    return (int(stats.get("cached_tokens", 0)) + int(stats.get("restored_tokens", 0))) / prompt


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def print_status(as_json: bool) -> int:
    """Print the fleet; exit status 0 (1 if no application runs). The caller has attached."""
    from hotloop_serve.serve.cluster import model_views

    views = model_views()
    if as_json:
        typer.echo(json.dumps([dataclasses.asdict(v) for v in views], indent=2))
        return 0 if views else 1
    if not views:
        typer.echo("no models are deployed")
        return 1
    for v in views:
        totals = {k: sum(int(r.stats.get(k, 0)) for r in v.replicas) for k in ("prompt_tokens", "cached_tokens",
                                                                               "restored_tokens")}  # fmt: skip
        typer.echo(f"{v.name}: {v.status}, {v.target}, cache hit {_pct(hit_rate(totals))}")
        head = f"  {'rank':>4}  {'replica':<10} {'state':<9} {'hot':>4} {'RAM':>4} {'disk':>4} {'turns':>6}"
        typer.echo(head + f" {'prompt tok':>10} {'hot hit':>8} {'restored':>8}  note")
        for r in sorted(v.replicas, key=lambda r: (r.rank is None, r.rank or 0, r.replica_id)):
            s = r.stats
            prompt = int(s.get("prompt_tokens", 0))
            hot = _pct(int(s.get("cached_tokens", 0)) / prompt) if prompt else "-"
            restored = _pct(int(s.get("restored_tokens", 0)) / prompt) if prompt else "-"
            rank = "-" if r.rank is None else str(r.rank)
            cells = [s.get(k, "-") for k in ("hot_sessions", "evicted_sessions", "disk_files", "turns")]
            typer.echo(
                f"  {rank:>4}  {r.replica_id:<10.10} {r.state:<9} {cells[0]:>4} {cells[1]:>4} {cells[2]:>4} "
                f"{cells[3]:>6} {prompt:>10} {hot:>8} {restored:>8}  {r.error or ''}"
            )
    return 0
