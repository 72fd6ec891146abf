"""`hotloop-serve apply`: plan, print, submit, wait, and report which replicas were kept."""

from __future__ import annotations

import time

import typer

from hotloop_serve.config import Config


def run_apply(config: Config, prune: bool, dry_run: bool, timeout_s: float) -> int:
    """Exit status: 0 applied (or nothing to do), 2 refused, 1 did not converge in time.

    The caller has attached to the server's Ray cluster.
    """
    from hotloop_serve.serve.apply_plan import make_plan, render
    from hotloop_serve.serve.cluster import live_state
    from hotloop_serve.serve.declarative import replicas_by_state, submit, wait_converged

    plan = make_plan(live_state(), config, prune=prune)
    for line in render(plan):
        typer.echo(line)
    if plan.refusals:
        typer.echo("nothing was changed")
        return 2
    if dry_run or not plan.changed:
        typer.echo("dry run: nothing was changed" if dry_run else "nothing to change")
        return 0
    before = {a["name"]: set(replicas_by_state(a["name"]).get("RUNNING", [])) for a in plan.apps}
    gone = set().union(*(before[name] for name in plan.rolling)) if plan.rolling else set()
    t0 = time.monotonic()
    submit(plan.apps)
    try:
        wait_converged(plan.apps, gone=gone, timeout_s=timeout_s)
    except (TimeoutError, RuntimeError) as e:
        typer.echo(f"applied, but {e}")
        return 1
    for change in plan.changes:
        if change.action in ("unchanged", "keep", "remove"):
            continue
        after = set(replicas_by_state(change.model).get("RUNNING", []))
        kept = len(after & before.get(change.model, set()))
        typer.echo(f"{change.model}: {len(after)} replicas running, {kept} kept, {len(after) - kept} new")
    typer.echo(f"applied in {time.monotonic() - t0:.1f} s")
    return 0
