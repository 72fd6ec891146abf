"""The synthetic engine (``engine.kind: synthetic``): the real engine's sessions, scheduler and KV
accounting with llama.cpp replaced by a clock; on the tiny generated GGUF's vocabulary."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from hotloop_serve.config import ModelConfig
from hotloop_serve.engine.chat_template import ChatMessage as M
from hotloop_serve.engine.config import EngineOptions
from hotloop_serve.engine.engine import Engine
from hotloop_serve.engine.settings import SamplingSettings
from hotloop_serve.engine.synthetic import SyntheticMemory, SyntheticRunner, open_engine
from hotloop_serve.errors import Cancelled

STEP_MS = 5.0


def synthetic(model: Path, **options: object) -> Engine:
    opts: dict[str, object] = {
        "kind": "synthetic",
        "synthetic_step_ms": STEP_MS,
        "context_tokens": 4096,
        "session_context_tokens": 1024,
        "hot_sessions": 4,
        **options,
    }
    return open_engine(str(model), EngineOptions(**opts))  # type: ignore[arg-type]


@pytest.fixture
def engine(tiny_model: Path) -> Iterator[Engine]:
    with synthetic(tiny_model) as e:
        yield e


def hello(text: str = "hello") -> list[M]:
    return [M("user", text)]


def test_options_name_the_kind_and_never_default_to_synthetic() -> None:
    assert EngineOptions().kind == "llama"
    assert ModelConfig().engine.kind == "llama"
    assert ModelConfig.model_validate({"engine": {"kind": "synthetic"}}).engine.kind == "synthetic"
    with pytest.raises(ValueError, match="kind"):
        EngineOptions(kind="fast")
    with pytest.raises(ValueError, match="synthetic_step_ms"):
        EngineOptions(kind="synthetic", synthetic_step_ms=0)


def test_open_engine_builds_the_synthetic_pieces(engine: Engine) -> None:
    assert isinstance(engine.runner, SyntheticRunner)
    assert isinstance(engine.runner.memory, SyntheticMemory)


def test_streams_one_token_per_step_up_to_sample_len(engine: Engine) -> None:
    stream = engine.generate("s", "o", hello(), SamplingSettings(sample_len=12))
    chunks = list(stream)
    assert len(chunks) >= 2, "a reply streams as it is generated, not in one piece"
    final = chunks[-1]
    assert final.finish_reason == "length"
    assert final.usage is not None and final.usage.completion_tokens == 12
    assert "".join(c.text for c in chunks).startswith("▁▁lorem")  # the tiny model's byte tokens


def test_steps_take_the_step_time(tiny_model: Path) -> None:
    with synthetic(tiny_model, synthetic_step_ms=20.0) as e:
        e.generate("warm", "o", hello(), SamplingSettings(sample_len=2)).result()
        t0 = time.perf_counter()
        e.generate("s", "o", hello(), SamplingSettings(sample_len=10)).result()
        took = time.perf_counter() - t0
    # One prefill step, then one step per further token: about 10 steps of 20 ms.
    assert 0.18 <= took <= 0.6, took


def test_batch_width_is_hot_sessions_and_the_rest_queue(engine: Engine) -> None:
    streams = [engine.generate(f"s{i}", "o", hello(), SamplingSettings(sample_len=8)) for i in range(10)]
    finals = [s.result() for s in streams]
    assert all(f.finish_reason == "length" and f.usage and f.usage.completion_tokens == 8 for f in finals)
    stats = engine.stats()
    assert stats.sessions == 10
    assert stats.hot_sessions <= 4
    # 10 replies of 8 tokens at 4 at once: at least 3 waves of 8 steps.
    assert stats.steps >= 24


def test_a_follow_up_reuses_the_session_cache(engine: Engine) -> None:
    first = engine.generate("s", "o", hello(), SamplingSettings(sample_len=4)).result()
    history = [*hello(), M("assistant", first.text), M("user", "and then?")]
    second = engine.generate("s", "o", history, SamplingSettings(sample_len=4)).result()
    assert second.usage is not None and second.usage.cached_tokens > 0
    info = engine.session_info("s", "o")
    assert info.context_tokens >= second.usage.prompt_tokens


def test_sessions_are_evicted_and_restored_under_kv_pressure(tiny_model: Path) -> None:
    # 2 sequences of 4 sessions' worth: the idle ones are evicted to RAM and restored exactly.
    with synthetic(tiny_model, context_tokens=512, session_context_tokens=256, hot_sessions=2) as e:
        for turn in range(2):
            for i in range(4):
                msgs = hello(f"session {i} turn {turn} " + "x" * 40)
                final = e.generate(f"s{i}", "o", msgs, SamplingSettings(sample_len=4)).result()
                assert final.finish_reason == "length"
        stats = e.stats()
        assert stats.evictions > 0
        assert stats.kv_tokens <= 512


def test_cancel_ends_the_stream(engine: Engine) -> None:
    stream = engine.generate("s", "o", hello(), SamplingSettings(sample_len=1000))
    it = iter(stream)
    next(it)
    stream.cancel()
    with pytest.raises(Cancelled):
        for _ in it:
            pass


def test_memory_saves_and_restores_cell_counts() -> None:
    mem = SyntheticMemory()
    mem.cells[0] = 7
    data = mem.save(0)
    assert data is not None
    assert mem.restore(1, data) and mem.cells[1] == 7
    mem.seq_rm(1, 3, -1)
    assert mem.cells[1] == 3
    mem.seq_cp(0, 2, 0, 5)
    assert mem.cells[2] == 5
    assert not mem.restore(3, data[:2])  # type: ignore[arg-type]
