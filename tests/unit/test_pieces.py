"""Model-free pieces: batch planning, streaming text, settings, templates, ids, auth, config."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest

from hotloop_serve.config import Config, config_from_dict
from hotloop_serve.engine.chat_template import ChatMessage as M
from hotloop_serve.engine.chat_template import ChatTemplate, builtin_template
from hotloop_serve.engine.sampling import TextAssembler
from hotloop_serve.engine.scheduler import PrefillPacer, plan_batch
from hotloop_serve.engine.settings import SamplingSettings
from hotloop_serve.errors import InvalidArgument, NotFound, Unauthenticated
from hotloop_serve.serve.auth import Authenticator
from hotloop_serve.serve.router import rendezvous_order
from hotloop_serve.serve.session_ids import SessionIds, routing_key


@dataclass
class R:
    decoding: bool
    prefill_remaining: int
    needs_logits: bool = False
    total: int = 0
    """Prompt tokens to prefill when it started (default: none done yet)."""

    @property
    def prefill_total(self) -> int:
        return max(self.total, self.prefill_remaining)


def test_decoders_get_one_token_each_and_prefill_is_chunked_beside_them() -> None:
    plan = plan_batch([R(True, 0), R(False, 1000), R(True, 0), R(False, 50)], batch_tokens=512, prefill_chunk=128)
    assert plan.decode == (0, 2)
    assert plan.prefill == ((3, 50), (1, 78))  # the short prompt first, the long one gets the rest
    assert plan.new_tokens == 130


def test_a_short_prompt_never_waits_behind_a_long_one() -> None:
    plan = plan_batch([R(False, 4000, True), R(False, 30, True)], batch_tokens=512, prefill_chunk=128)
    assert plan.prefill == ((1, 30), (0, 128))


def test_the_last_prompt_token_rides_with_its_prompt() -> None:
    # The runner, not the plan, decodes it apart when batch_invariant asks (ModelRunner.execute).
    assert plan_batch([R(False, 20, True)], 512, 128).prefill == ((0, 20),)


def test_a_prompt_alone_uses_the_whole_batch() -> None:
    assert plan_batch([R(False, 600)], batch_tokens=512, prefill_chunk=128).prefill == ((0, 512),)


def test_prompts_that_arrive_together_finish_prefilling_in_the_same_step() -> None:
    # A burst of new chats of different lengths: the longest get more until all are level,
    # so no session starts decoding alone (its decoding would pace the others' prefill).
    burst = [R(False, n, True, n) for n in (950, 1000, 1020, 1050, 1080, 1100, 1060, 990)]
    steps, done_at = 0, set()
    while any(r.prefill_remaining for r in burst):
        plan = plan_batch(burst, batch_tokens=512, prefill_chunk=128)
        assert plan.new_tokens == 512 or (steps > 10 and plan.new_tokens < 512)
        assert all(n <= 128 for _, n in plan.prefill)
        for i, n in plan.prefill:
            burst[i].prefill_remaining -= n
            if not burst[i].prefill_remaining:
                done_at.add(steps)
        steps += 1
    assert done_at == {steps - 1}  # all 8 prompts (last tokens included) finish in the same step


def test_long_prompts_get_whole_attention_tiles_and_still_finish_together() -> None:
    # Five prompts share 512 rows: 102-103 each would put two prompts in one 64-row flash
    # attention tile; whole tiles instead, one piece taking what is left of the budget.
    burst = [R(False, n, True, n) for n in (1000, 1010, 1020, 1030, 1040)]
    first = plan_batch(burst, batch_tokens=512, prefill_chunk=128)
    assert first.new_tokens == 512
    assert sum(n % 64 != 0 for _, n in first.prefill) <= 1
    steps, done_at = 0, set()
    while any(r.prefill_remaining for r in burst):
        plan = plan_batch(burst, batch_tokens=512, prefill_chunk=128)
        unfinished = [n for i, n in plan.prefill if n < burst[i].prefill_remaining]
        assert sum(n % 64 != 0 for n in unfinished) <= 1
        for i, n in plan.prefill:
            burst[i].prefill_remaining -= n
            if not burst[i].prefill_remaining:
                done_at.add(steps)
        steps += 1
    assert done_at == {steps - 1}


def test_an_early_prompt_keeps_advancing_beside_a_newcomer() -> None:
    # Half an equal share each at least; the rest levels the newcomer down.
    plan = plan_batch([R(False, 300, True, 1000), R(False, 4000, True)], batch_tokens=512, prefill_chunk=128)
    assert plan.prefill == ((0, 128), (1, 128))
    plan = plan_batch([R(True, 0), R(False, 300, True, 1000), R(False, 4000, True)], 512, 128, paced_budget=40)
    assert plan.prefill == ((1, 10), (2, 30))


def test_follow_ups_arriving_together_start_one_per_step_until_someone_decodes() -> None:
    wave = [R(False, 22, True) for _ in range(4)]
    assert plan_batch(wave, 512, 128).prefill == ((0, 22),)
    wave[0] = R(True, 0)  # it decodes: the others' prompts join the paced steps
    assert plan_batch(wave, 512, 128, paced_budget=60).prefill == ((1, 22), (2, 22), (3, 16))


def test_shortest_first_gives_the_nearest_to_done_prompt_all_it_needs_and_fills_the_batch() -> None:
    plan = plan_batch([R(False, 300)] * 5, batch_tokens=512, prefill_chunk=128, fair=False)
    assert plan.prefill == ((0, 300), (1, 212))
    plan = plan_batch([R(False, 900), R(False, 20, True), R(False, 300)], 512, 128, fair=False)
    assert plan.prefill == ((1, 20), (2, 300), (0, 192))
    plan = plan_batch([R(True, 0), R(False, 1000), R(False, 900)], 512, 128, paced_budget=40, fair=False)
    assert plan.prefill == ((2, 40),)


def test_a_follow_up_is_planned_whole_beside_others() -> None:
    assert plan_batch([R(True, 0), R(False, 20, True)], 512, 128).prefill == ((1, 20),)
    assert plan_batch([R(False, 20, True), R(False, 900, False)], 512, 128).prefill == ((0, 20), (1, 128))


def test_beside_decoders_the_paced_budget_replaces_the_chunk() -> None:
    plan = plan_batch([R(True, 0), R(False, 1000), R(False, 900)], 512, 128, paced_budget=40)
    assert plan.prefill == ((2, 10), (1, 30))  # the long prompts share the paced budget, levelling
    plan = plan_batch([R(True, 0), R(False, 1000), R(False, 30, True)], 512, 128, paced_budget=40)
    assert plan.prefill == ((2, 30), (1, 10))  # a follow-up message goes first, in full
    plan = plan_batch([R(True, 0), R(False, 1000)], 512, 128, paced_budget=400)  # a fast device
    assert plan.prefill == ((1, 400),)
    plan = plan_batch([R(False, 1000), R(False, 900)], 512, 128, paced_budget=40)  # nobody decoding
    assert plan.prefill == ((1, 128), (0, 128))


def test_the_pacer_sizes_prefill_so_a_step_lasts_its_target() -> None:
    pacer = PrefillPacer(step_target_ms=150, prefill_chunk=128, batch_tokens=512)
    assert pacer.budget() == 128  # nothing measured yet
    pacer.observe(decode_tokens=4, prefill_tokens=0, seconds=0.030)
    pacer.observe(decode_tokens=4, prefill_tokens=128, seconds=0.030 + 128 * 0.0025)
    assert pacer.budget() == 48  # (150 - 30) ms / 2.5 ms per token
    for _ in range(40):  # the decoders alone now take longer than the target: prompts still advance
        pacer.observe(decode_tokens=8, prefill_tokens=0, seconds=0.2)
    assert pacer.budget() == PrefillPacer.MIN_TOKENS
    fast = PrefillPacer(step_target_ms=150, prefill_chunk=128, batch_tokens=512)
    fast.observe(4, 0, 0.005)
    fast.observe(4, 256, 0.005 + 256 * 0.00005)
    assert fast.budget() == 512  # a GPU: the whole batch fits in the target
    off = PrefillPacer(step_target_ms=0, prefill_chunk=128, batch_tokens=512)
    off.observe(4, 0, 0.03)
    off.observe(4, 128, 0.4)
    assert off.budget() == 128


@pytest.mark.parametrize("text", ["héllo wörld", "日本語のテキスト", "emoji 😀🎉 end", "ascii"])
def test_utf8_split_across_tokens_is_never_emitted_broken(text: str) -> None:
    a = TextAssembler(())
    out = [a.feed(bytes([b])) for b in text.encode()]
    assert "".join(out) + a.flush() == text
    assert all("\ufffd" not in piece for piece in out)


def test_stop_sequence_is_held_back_then_cut() -> None:
    a = TextAssembler(("END",))
    pieces = [a.feed(p.encode()) for p in ("Hello E", "N", "D tail")]
    assert "".join(pieces) == "Hello "
    assert a.stopped


def test_stop_prefix_that_does_not_complete_is_released() -> None:
    a = TextAssembler(("END",))
    got = a.feed(b"an E") + a.feed(b"lephant") + a.flush()
    assert got == "an Elephant" and not a.stopped


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("temperature", -0.1, "temperature"),
        ("temperature", math.nan, "finite"),
        ("top_p", 0.0, "top_p"),
        ("top_p", 1.5, "top_p"),
        ("sample_len", 0, "sample_len"),
        ("top_k", -1, "top_k"),
        ("repeat_penalty", 0.0, "repeat_penalty"),
        ("min_p", 1.0, "min_p"),
        ("seed", -1, "seed"),
    ],
)
def test_bad_settings_name_the_field(field: str, value: float, message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        SamplingSettings().merged(**{field: value})


def test_sample_len_server_cap() -> None:
    with pytest.raises(InvalidArgument, match="<= 100"):
        SamplingSettings(sample_len=101).validate(max_sample_len=100)


def test_gemma_fallback_template_and_warmup_prefix() -> None:
    name, source = builtin_template("gemma3")
    t = ChatTemplate(source, f"builtin:{name}", "<bos>")
    warm = t.render([M("system", "Be brief.")], add_generation_prompt=False)
    full = t.render([M("system", "Be brief."), M("user", "Hi")])
    assert full == "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n"
    assert full.startswith(warm)
    two = t.render([M("user", "Hi"), M("assistant", "Hello!"), M("user", "More")])
    assert "<start_of_turn>model\nHello!<end_of_turn>\n" in two


def test_bad_template_is_a_clear_error() -> None:
    with pytest.raises(InvalidArgument, match="does not compile"):
        ChatTemplate("{% for %}", "config")


def test_session_ids_bind_principal_and_model() -> None:
    ids = SessionIds(b"secret", "m")
    sid = ids.new("alice", "client-key-1")
    assert routing_key(sid) == "client-key-1"
    assert ids.verify(sid, "alice") == sid
    with pytest.raises(NotFound):
        ids.verify(sid, "bob")
    with pytest.raises(NotFound):
        SessionIds(b"secret", "other-model").verify(sid, "alice")
    with pytest.raises(NotFound):
        ids.verify("made-up-id.xxxx", "alice")
    with pytest.raises(InvalidArgument, match="session_key"):
        ids.new("alice", "bad key!")


def test_bearer_tokens() -> None:
    auth = Authenticator({"alice": "t-a", "bob": "t-b"})
    assert auth.principal([("authorization", "Bearer t-b")]) == "bob"
    for md in ([], [("authorization", "Bearer nope")], [("authorization", "Basic t-a")]):
        with pytest.raises(Unauthenticated):
            auth.principal(md)
    assert Authenticator({}).principal([]) == "anonymous"


def test_rendezvous_moves_about_one_nth_when_a_replica_joins() -> None:
    keys = [f"session-{i}" for i in range(3000)]
    before = {k: ["0", "1", "2"][rendezvous_order(k, ["0", "1", "2"])[0]] for k in keys}
    after = {k: ["0", "1", "2", "3"][rendezvous_order(k, ["0", "1", "2", "3"])[0]] for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert all(after[k] == "3" for k in moved)  # only to the new replica
    assert 0.18 < len(moved) / len(keys) < 0.32  # about 1/4
    counts = [list(before.values()).count(r) for r in "012"]
    assert max(counts) / min(counts) < 1.15  # spread evenly


def test_config_rejects_unknown_keys_and_bad_values() -> None:
    assert Config().models[0].path.startswith("embedded:")
    with pytest.raises(ValueError, match="replicas"):
        config_from_dict({"models": [{"name": "m", "replicas": -1}]})
    with pytest.raises(ValueError, match=r"extra|unexpected"):
        config_from_dict({"models": [{"name": "m", "replica": 2}]})
    with pytest.raises(ValueError, match="unique"):
        config_from_dict({"models": [{"name": "m"}, {"name": "m"}]})


def test_deployment_options_from_config() -> None:
    from hotloop_serve.serve.app import CONTROL_HEADROOM, deployment_options, serve_config
    from hotloop_serve.serve.servicer import HEALTH_WATCHES

    cfg = config_from_dict(
        {
            "models": [
                {"name": "a", "engine": {"hot_sessions": 6}, "env": {"X": "1"}},
                {
                    "name": "b",
                    "autoscaling": {"min_replicas": 1, "max_replicas": 3},
                    "routing": {"session_affinity": False},
                },
            ]
        }
    )
    a, b = (deployment_options(m) for m in cfg.models)
    # the engine's batch (6) and queue (64), plus headroom for control RPCs and health watches
    assert a["num_replicas"] == 1 and a["max_ongoing_requests"] == 6 + 64 + CONTROL_HEADROOM + HEALTH_WATCHES
    assert a["ray_actor_options"]["runtime_env"] == {"env_vars": {"X": "1"}}
    assert "SessionAffinityRouter" in a["request_router_config"].request_router_class
    assert b["autoscaling_config"].max_replicas == 3 and "num_replicas" not in b
    assert "request_router_config" not in b
    doc = serve_config(cfg)
    assert [app["name"] for app in doc["applications"]] == ["a", "b"]
    assert config_from_dict(doc["applications"][0]["args"]["config"]) == cfg


def test_a_whole_follow_up_still_fits_the_batch() -> None:
    # Past the paced budget, never past llama.cpp's batch: 250 decoders leave 6 slots.
    active = [R(True, 0)] * 250 + [R(False, 60, True), R(False, 1, True)]
    plan = plan_batch(active, batch_tokens=256, prefill_chunk=128, paced_budget=16)
    assert plan.new_tokens <= 256
    assert plan.prefill == ((251, 1), (250, 5))


@pytest.mark.parametrize("fair", [True, False])
def test_random_plans_fit_the_batch_and_never_overshoot_a_prompt(fair: bool) -> None:
    import random

    rng = random.Random(7)
    for _ in range(2000):
        batch = rng.choice([16, 64, 512])
        active = [
            R(True, 0) if rng.random() < 0.4 else R(False, rng.randint(1, 900), rng.random() < 0.8, rng.randint(0, 900))
            for _ in range(rng.randint(1, min(batch, 40)))
        ]
        paced = rng.choice([None, 16, 40, 300])
        plan = plan_batch(active, batch, prefill_chunk=min(128, batch), paced_budget=paced, fair=fair)
        assert plan.new_tokens <= batch
        seen = [i for i, _ in plan.prefill]
        assert len(seen) == len(set(seen))
        for i, n in plan.prefill:
            r = active[i]
            assert not r.decoding and 0 < n <= r.prefill_remaining
