"""Engine options: how one replica's llama.cpp context is shaped and bounded.

A plain dataclass (the engine imports no pydantic); ``hotloop_serve.config`` embeds it in
the YAML schema, so the same names appear in the config file, the Helm values and here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

GiB = 1024**3
KV_TYPES = ("f16", "q8_0", "q4_0")
ENGINE_KINDS = ("llama", "synthetic")


@dataclass(frozen=True)
class EngineOptions:
    """Shape and bounds of one replica's engine. Every bound, when hit, is named in the error."""

    __pydantic_config__: ClassVar[dict[str, str]] = {"extra": "forbid"}

    kind: str = "llama"
    """``llama``: llama.cpp decodes the model. ``synthetic``: a load generator, not a model: every
    step waits ``synthetic_step_ms`` and streams one token per decoding session from a fixed
    vocabulary (``synthetic.py``), to measure the serving layer at an accelerator's token rates
    on any machine. The Helm chart refuses it unless ``allowSyntheticEngine`` is set."""
    synthetic_step_ms: float = 15.0
    """With ``kind: synthetic``, the time one step takes (batch width: ``hot_sessions``)."""
    context_tokens: int = 16384
    """KV cache cells shared by all hot sessions of the replica (llama.cpp's n_ctx)."""
    session_context_tokens: int = 8192
    """Most tokens one session may hold (prompt + reply); capped by the model's training context."""
    hot_sessions: int = 8
    """Requests (turns) running at once: the batch width. Others wait in the engine's queue,
    cheapest first (``scheduler.py``)."""
    resident_sessions: int = 0
    """Sessions whose KV may stay in the context at once (llama.cpp's n_seq_max; 0 = ``hot_sessions``).
    Above ``hot_sessions`` (unified layout only), an idle session keeps its cells while the pool
    has room, so its next turn restores nothing; idle sessions are evicted to host RAM (least
    recently used first) only when cells or sequences run short. At most 256."""
    max_sessions: int = 256
    """Sessions a replica keeps track of (hot, evicted to RAM or dropped)."""
    evicted_bytes: int = 2 * GiB
    """Host RAM for evicted sessions' KV state; beyond it the LRU ones are dropped and rebuilt."""
    max_queue: int = 64
    """Requests waiting for a sequence; more get RESOURCE_EXHAUSTED at once."""
    batch_tokens: int = 512
    """Tokens per llama_decode call (llama.cpp's n_batch / n_ubatch)."""
    prefill_chunk: int = 128
    """Prefill tokens per prompt and step while other requests share the engine (and per step
    beside decoding sessions until their step time is measured, or with ``step_target_ms`` 0)."""
    step_target_ms: float = 150.0
    """While sessions are decoding, others' prompts join a step only up to what keeps it about
    this long (sized from measured step times), so a decoding session's time between tokens
    stays near it while newcomers prefill; a newcomer's prompt then takes more, shorter steps
    (bench/engine.py row 0e measures both sides). 0 = ``prefill_chunk`` tokens per step."""
    followup_wait_ms: float = 50.0
    """When a session's reply ends while the replica is busy, the next step waits up to this
    long (and at most a quarter of a measured decoding step) for that session's next turn, if
    its client came back within that time after its previous reply (agent loops, tool calls,
    scripted chats): the new turn then starts in that step instead of a whole step later (on
    CPU a step is long). A session whose client took longer is not waited for
    until it comes back that fast again, so human-paced chats cost nothing. 0 = never wait."""
    followup_slot_ms: float = 500.0
    """When a session's reply ends, its running slot stays reserved this long for the session's
    next turn (other requests wait), if its client came back within this time after its previous
    reply (agents, tool loops, scripted chats): through a proxy the next turn lands tens to
    hundreds of milliseconds after the reply, and without the reservation it would queue behind
    every first turn waiting for a slot although its history is cached. Clients slower than
    this (people typing) are not waited for. 0 = no reservation."""
    prefill_policy: str = "shortest_first"
    """How prompts share a step's prefill budget. ``shortest_first`` (the default): the prompt
    nearest to done takes all it needs, the next ones what is left (shortest remaining processing
    time: for a burst of first turns the mean time to first token is lowest, for the same work;
    a follow-up message is always the shortest). ``fair``: long prompts get equal shares, so
    sessions whose first turns arrive together finish prefilling together and then decode in the
    same, wide steps; prompts of at most ``prefill_chunk / 2`` tokens still go first. Measured
    against llama.cpp's own server in bench/peer.py (``--workload w1``)."""
    shared_prefix_min_tokens: int = 16
    """Shortest common prefix worth copying from another session of the same owner."""
    threads: int = 0
    """CPU threads for decoding; 0 = the cores this process may use: its CPU affinity, capped by
    its container's CPU limit (the cgroup's quota, ``engine/cpus.py``). Several replicas on one
    machine each take all of them unless this is set (the Helm chart sets it to each model's
    ``resources.num_cpus``)."""
    gpu_layers: int = 0
    """Layers offloaded to the GPU; -1 = all of them."""
    batch_invariant: bool = True
    """Keep a session's tokens as independent of who shares its step as llama.cpp's CPU kernels
    allow: weights are not repacked (repacked kernels round differently for 1 and N rows), flash
    attention skips masked cells, and the rows that make logits (decoders, a reply's last prompt
    token) run in a ``llama_decode`` of their own, apart from the step's prompt rows (a batch of
    8 rows or more rounds differently from 1-7). Measured (bench/invariance.py; bench/README.md,
    ``invariance.py``): with up to 7 such rows a step, a greedy reply is the same alone and
    beside others' prompts, and an evicted and restored session continues exactly; from 8
    decoders on, and with a prompt split into other chunks, logits move (by up to ~1) and a
    near-tie can flip. It costs some single-stream speed and a ``llama_decode`` more per step
    that prefills beside decoders (``bench/invariance.py`` and ``bench/engine.py`` measure it)."""
    flash_attention: bool = True
    """llama.cpp's flash attention. On by default: its CPU kernel skips masked cells, so a step's
    attention costs the cells its own sequences use, where the plain path multiplies every cell
    of the unified pool (the cells of all resident sessions). Off only to compare
    (bench/replay.py); it is forced on by ``batch_invariant`` and by quantized values."""
    deterministic: bool = False
    """Make a reply a function of its history, settings and model alone (greedy, or sampled with
    a fixed seed): the same whether the session's cache was decoded or prefilled, in whatever
    chunks, restored from RAM or disk, handed over from another replica or rebuilt, and whatever
    else shares the replica. ``batch_invariant`` is not enough for that: llama.cpp's CPU
    kernels round a row by the shape of the batch it is in, so a token prefilled in a chunk of
    its prompt caches other keys and values than the same token decoded, and a row alone in
    a micro-batch over more than 256 cells sums its attention in per-thread parts that follow
    the cells in use. Here every ``llama_decode``, and every micro-batch llama.cpp cuts it
    into, holds 2 to 7 rows (the class in which a row's arithmetic does not depend on the
    others; a row with no neighbouring sequence in its call gets a shadow row of its own
    sequence, ``engine/canonical.py``), prompts are prefilled 2-7 tokens a call, and each
    session's cells must lie in the order of its positions, which only ``kv_layout:
    per_session`` guarantees (a unified pool places a growing session in whatever cells are
    free; attention adds the cells up in cell order).
    Requires ``kv_layout: per_session``; implies what ``batch_invariant`` sets on the context.
    Costs prefill throughput (small batches; measured in bench/engine.py) and one token of
    each session's window (a cell kept free for the shadow row). Replicas agree only on
    the same CPU instruction set (llama.cpp picks its kernels by CPU). docs/reliability.md."""
    kv_layout: str = "unified"
    """``unified``: one pool of ``context_tokens`` cells shared by all hot sessions (any session may
    grow to ``session_context_tokens``). ``per_session``: each hot session gets its own stream of
    ``context_tokens / hot_sessions`` cells (faster attention at many sessions; that is then
    also the per-session cap, and shared prefixes are not copied between sessions: llama.cpp
    copies across streams only whole). See bench/engine.py for the measured trade-off."""
    swa_full: bool = True
    """Keep a full-size cache for sliding-window layers (Gemma 3), so a cache can be cut at any
    turn without a rebuild. Off: smaller and faster, but an edited turn older than the window
    re-prefills the whole history."""
    kv_type_k: str = "f16"
    """Data type of cached keys: f16, q8_0 (about half the bytes) or q4_0."""
    kv_type_v: str = "f16"
    """Data type of cached values: f16, q8_0 or q4_0 (quantized values need flash attention,
    which is then turned on)."""
    persist_dir: str = ""
    """A directory (a volume) where sessions dropped from host RAM, and hot ones at a graceful
    shutdown, are kept so they survive restarts; empty = no disk tier."""
    persist_bytes: int = 8 * GiB
    """Disk budget of ``persist_dir``; past it the least recently used files are deleted."""
    idle_ttl_s: float = 3600.0
    """A session untouched this long is forgotten."""
    seed: int = 0
    """Seed of the seed generator for sessions without a fixed seed (0 = from the OS)."""

    def __post_init__(self) -> None:
        checks = {
            "kind": self.kind in ENGINE_KINDS,
            "synthetic_step_ms": 0 < self.synthetic_step_ms <= 10_000,
            "context_tokens": self.context_tokens >= 64,
            "session_context_tokens": 32 <= self.session_context_tokens <= self.context_tokens,
            "evicted_bytes": self.evicted_bytes >= 0,
            "hot_sessions": 1 <= self.hot_sessions <= 256,
            "resident_sessions": self.resident_sessions == 0
            or (
                self.hot_sessions <= self.resident_sessions <= 256
                and (self.kv_layout == "unified" or self.resident_sessions == self.hot_sessions)
            ),
            "max_sessions": self.max_sessions >= self.hot_sessions,
            "max_queue": self.max_queue >= 0,
            "batch_tokens": 8 <= self.batch_tokens <= 8192 and self.batch_tokens >= self.hot_sessions,
            "prefill_chunk": 1 <= self.prefill_chunk <= self.batch_tokens,
            "step_target_ms": 0 <= self.step_target_ms <= 60_000,
            "followup_wait_ms": 0 <= self.followup_wait_ms <= 10_000,
            "followup_slot_ms": 0 <= self.followup_slot_ms <= 60_000,
            "prefill_policy": self.prefill_policy in ("fair", "shortest_first"),
            "shared_prefix_min_tokens": self.shared_prefix_min_tokens >= 1,
            "threads": self.threads >= 0,
            "gpu_layers": self.gpu_layers >= -1,
            "idle_ttl_s": self.idle_ttl_s > 0,
            "persist_bytes": self.persist_bytes >= 0,
            "kv_layout": self.kv_layout in ("unified", "per_session"),
            "deterministic": not self.deterministic or self.kv_layout == "per_session",
            "kv_type_k": self.kv_type_k in KV_TYPES,
            "kv_type_v": self.kv_type_v in KV_TYPES,
        }
        bad = [name for name, ok in checks.items() if not ok]
        if bad:
            raise ValueError(
                f"invalid engine option {bad[0]}={getattr(self, bad[0])!r}: see EngineOptions.{bad[0]} for its range"
            )

    @property
    def sequences(self) -> int:
        """llama.cpp sequences of the context: :attr:`resident_sessions`, resolved."""
        if self.kv_layout == "per_session" or not self.resident_sessions:
            return self.hot_sessions
        return self.resident_sessions
