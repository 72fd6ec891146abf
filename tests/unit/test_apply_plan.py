"""``apply``'s plan: which models change in place, which roll, what is refused (no Ray needed)."""

from __future__ import annotations

from typing import Any

from hotloop_serve.config import Config, config_from_dict
from hotloop_serve.serve.apply_plan import ADD, IN_PLACE, KEEP, REMOVE, ROLL, UNCHANGED, Live, make_plan
from hotloop_serve.serve.declarative import applications, code_config, fleet_options, target_replicas


def cfg(**model: Any) -> Config:
    return config_from_dict({"server": {"grpc_port": 9100}, "models": [{"name": "m", **model}]})


def live(config: Config, imperative: set[str] | None = None) -> Live:
    return Live(9100, 8000, "127.0.0.1", None, {a["name"]: a for a in applications(config)}, imperative or set())


def verdicts(old: Config, new: Config, prune: bool = False) -> dict[str, str]:
    return {c.model: c.action for c in make_plan(live(old), new, prune).changes}


def test_fleet_fields_stay_out_of_the_code_version() -> None:
    """Serve rebuilds (new replicas) when an app's args change: the args must not see fleet fields."""
    assert code_config(cfg(replicas=3)) == code_config(cfg(autoscaling={"min_replicas": 1, "max_replicas": 4}))
    assert code_config(cfg(routing={"max_ongoing_requests": 7})) == code_config(cfg())
    assert code_config(cfg(engine={"seed": 5})) != code_config(cfg())
    fixed, scaled = fleet_options(cfg(replicas=3).models[0]), fleet_options(cfg(autoscaling={}).models[0])
    assert fixed["num_replicas"] == 3 and fixed["autoscaling_config"] is None
    assert scaled["num_replicas"] is None and scaled["autoscaling_config"]["max_replicas"] == 2
    assert target_replicas(applications(cfg(replicas=3))[0]) == (3, 3)


def test_replicas_and_autoscaling_change_in_place() -> None:
    plan = make_plan(live(cfg(replicas=2)), cfg(replicas=3))
    (change,) = plan.changes
    assert change.action == IN_PLACE and change.details == ["num_replicas: 2 -> 3"]
    bounds = {"min_replicas": 1, "max_replicas": 3}
    assert verdicts(cfg(autoscaling=bounds), cfg(autoscaling={**bounds, "max_replicas": 5})) == {"m": IN_PLACE}
    assert verdicts(cfg(routing={"max_ongoing_requests": 9}), cfg()) == {"m": IN_PLACE}
    assert verdicts(cfg(), cfg()) == {"m": UNCHANGED}
    assert not make_plan(live(cfg()), cfg()).changed


def test_engine_and_limits_roll_with_the_reason() -> None:
    plan = make_plan(live(cfg()), cfg(engine={"seed": 7}, limits={"max_messages": 10}))
    (change,) = plan.changes
    assert change.action == ROLL and plan.rolling == {"m"}
    assert "models[m].engine.seed: 0 -> 7" in change.details
    assert "models[m].limits.max_messages: 1024 -> 10" in change.details
    (switch,) = make_plan(live(cfg(replicas=2)), cfg(autoscaling={})).changes
    assert switch.action == ROLL and any("switching to autoscaling" in d for d in switch.details)


def test_added_kept_and_pruned_models() -> None:
    two = config_from_dict({"server": {"grpc_port": 9100}, "models": [{"name": "m"}, {"name": "n"}]})
    plan = make_plan(live(cfg()), two)
    assert {c.model: c.action for c in plan.changes} == {"m": ROLL, "n": ADD}  # m lists every model
    assert any("model list changed" in d for d in plan.changes[0].details)
    kept = make_plan(live(two), cfg(replicas=2))
    assert {c.model: c.action for c in kept.changes} == {"m": ROLL, "n": KEEP}
    assert [a["name"] for a in kept.apps] == ["m", "n"]  # n re-submitted as it runs
    pruned = make_plan(live(two), cfg(), prune=True)
    assert {c.model: c.action for c in pruned.changes}["n"] == REMOVE and [a["name"] for a in pruned.apps] == ["m"]


def test_what_the_proxies_fixed_at_start_is_refused() -> None:
    moved = config_from_dict({"server": {"grpc_port": 9200}, "models": [{"name": "m"}]})
    (refusal,) = make_plan(live(cfg()), moved).refusals
    assert "server.grpc_port 9100 -> 9200" in refusal and "hotloop-serve stop" in refusal
    bigger = cfg(limits={"max_request_bytes": 64 * 1024 * 1024})
    assert any("max_request_bytes" in r for r in make_plan(live(cfg()), bigger).refusals)
    clash = make_plan(Live(9100, 8000, "127.0.0.1", None, {}, {"m"}), cfg())
    assert clash.refusals and "serve.run" in clash.refusals[0]
