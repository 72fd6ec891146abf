"""Untrusted bytes (issue 33): bounded JSON, schema and grammar bounds, the grammar trial child,
signed session blobs and the consistency check of their KV state, on the tiny model and Gemma.

Each case is one of the inputs that crashed, hung or starved a replica before: it must now get
a clear INVALID_ARGUMENT (or RESOURCE_EXHAUSTED), fast, with the engine still serving.
"""

from __future__ import annotations

import hashlib
import json
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from hotloop_serve import bounded_json
from hotloop_serve.engine import ChatMessage as M
from hotloop_serve.engine import Engine, EngineOptions, SamplingSettings
from hotloop_serve.engine.grammar import (
    MAX_GBNF_NESTING,
    MAX_REPETITION,
    GrammarProbe,
    check_grammar,
    schema_to_grammar,
)
from hotloop_serve.engine.kv_state import STATE_MAGIC, check_state
from hotloop_serve.engine.persist import MAGIC, BlobKeys, SessionBlob, settings_to_dict
from hotloop_serve.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from hotloop_serve.serve.quotas import AnonymousSessions, PendingImports, caller_key

GREEDY = SamplingSettings(temperature=0, sample_len=8, repeat_penalty=1.0)
OPTS = EngineOptions(context_tokens=4096, session_context_tokens=1024, hot_sessions=2)
KEYS = BlobKeys([b"this fleet's export key, 32 bytes"])


def nested_schema(levels: int) -> str:
    """A schema of ``levels`` nested objects, as text (json.dumps itself recurses per level)."""
    return '{"type": "object", "properties": {"a": ' * levels + '{"type": "string"}' + "}}" * levels


EXPONENTIAL = "\n".join(
    ["root ::= a0"] + [f'a{i} ::= a{i + 1} "x" | a{i + 1} "y"' for i in range(22)] + ['a22 ::= "z"']
)
"""~570 bytes whose initial parse stacks number 2^22: llama.cpp's grammar init never ends."""


# -- bounded JSON --------------------------------------------------------------------------
def test_json_nested_100000_deep_is_invalid_argument_not_a_recursion_error() -> None:
    deep = "[" * 100_000 + "]" * 100_000
    with pytest.raises(InvalidArgument, match="nests deeper than 64"):
        bounded_json.loads(deep, "the request body")
    with pytest.raises(InvalidArgument, match="nests deeper than 3"):
        bounded_json.loads('{"a": {"b": {"c": {"d": 1}}}}', "x", max_depth=3)
    assert bounded_json.loads('{"a": [1, {"b": 2}]}', "x", max_depth=3) == {"a": [1, {"b": 2}]}
    with pytest.raises(InvalidArgument, match="not valid JSON"):
        bounded_json.loads(b"\xff{", "x")


# -- static bounds of schemas and grammars ---------------------------------------------------
@pytest.mark.parametrize(
    ("schema", "says"),
    [
        ('{"a":' * 2_000 + "1" + "}" * 2_000, "nests deeper than 32"),
        ('{"a":' * 10_000 + "1" + "}" * 10_000, "nests deeper than 32"),
        (nested_schema(2_000), "must be at most 65536 bytes"),
        ('{"type": "string", "maxLength": 1000000}', f"maxLength is 1000000; at most {MAX_REPETITION}"),
        ('{"type": "array", "items": {"type": "integer"}, "minItems": 5000}', "minItems is 5000"),
        ('{"type": "string", "maxLength": -1}', "maxLength must be a non-negative integer"),
        ('{"$ref": "https://example.com/schema.json"}', "only local references"),
        ('{"type": "string", "pattern": "^a{1,100000}$"}', "pattern repeats an item 100000 times"),
    ],
)
def test_schemas_past_a_bound_are_refused_before_the_converter(schema: str, says: str) -> None:
    t0 = time.perf_counter()
    with pytest.raises(InvalidArgument) as info:
        SamplingSettings(json_schema=schema)
    assert says in info.value.message
    assert info.value.field == "json_schema"
    assert time.perf_counter() - t0 < 1.0


def test_a_schema_at_the_bounds_converts() -> None:
    grammar = schema_to_grammar(json.dumps({"type": "string", "maxLength": MAX_REPETITION}))
    assert "root" in grammar
    schema_to_grammar(nested_schema(14))  # 29 levels of objects: within the depth bound


@pytest.mark.parametrize(
    ("grammar", "says"),
    [
        ("root ::= " + "(" * 32_000 + '"a"' + ")" * 32_000, "nests groups 32000 deep"),
        ('root ::= "a"{0,5000}', "repeats an item 5000 times"),
        ("\n".join(f'x{i}::="a"' for i in range(5000)) + "\nroot ::= x0", "has 5001 rules"),
        ('root ::= "a\0"', "NUL"),
    ],
)
def test_grammars_past_a_bound_are_refused_before_llama_cpp(grammar: str, says: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        check_grammar(grammar)
    assert says in info.value.message


def test_parentheses_inside_literals_classes_and_comments_do_not_count() -> None:
    hidden = "(" * (MAX_GBNF_NESTING + 10)
    check_grammar(f'root ::= "{hidden}" [{hidden}] # {hidden}\n')
    check_grammar('root ::= "\\"(((" "a"')  # an escaped quote does not end the literal


# -- the trial build in a child process ---------------------------------------------------------
@pytest.fixture(scope="module")
def probe(gemma_model: Path) -> Iterator[GrammarProbe]:
    p = GrammarProbe(gemma_model)
    yield p
    p.close()


def test_the_trial_child_refuses_a_grammar_that_overflows_llama_cpps_stack(probe: GrammarProbe) -> None:
    """Past the static bound's reach (the probe is called directly): llama.cpp's parser recursion
    kills the child, not the caller, and the next check runs on a fresh child."""
    deep = "root ::= " + "(" * 32_000 + '"a"' + ")" * 32_000
    with pytest.raises(InvalidArgument, match="too complex"):
        probe.check(deep)
    probe.check('root ::= "yes" | "no"')
    assert probe.counters["child_restarts"] >= 1


def test_an_exponential_grammar_is_abandoned_within_the_budget(probe: GrammarProbe) -> None:
    probe.check('root ::= "warm"')  # the child is up
    threads = threading.active_count()
    t0 = time.perf_counter()
    with pytest.raises(InvalidArgument, match="too costly"):
        probe.check(EXPONENTIAL)
    assert time.perf_counter() - t0 < probe.budget_s + 1.5
    t0 = time.perf_counter()
    with pytest.raises(InvalidArgument, match="too costly"):
        probe.check(EXPONENTIAL)  # the verdict is cached: no second child spins on it
    assert time.perf_counter() - t0 < 0.05
    probe.check('root ::= "after"')
    assert threading.active_count() <= threads + 1  # at most the reaper of the killed child


def test_json_schema_grammars_pass_the_trial(probe: GrammarProbe) -> None:
    probe.check(schema_to_grammar('{"type": "object", "properties": {"a": {"type": "string", "maxLength": 1000}}}'))
    with pytest.raises(InvalidArgument, match="not valid GBNF"):
        probe.check('root ::= "a')


def test_a_busy_checker_answers_resource_exhausted_not_a_hang(gemma_model: Path) -> None:
    p = GrammarProbe(gemma_model, budget_s=2.0)
    try:
        p.check('root ::= "warm"')
        done: list[BaseException | None] = []
        worker = threading.Thread(target=lambda: _record(done, p, EXPONENTIAL))
        worker.start()
        time.sleep(0.2)
        with pytest.raises((ResourceExhausted, InvalidArgument)):
            # Waits for the lock at most PROBE_QUEUE_S: either the first check ended meanwhile and
            # this one ran (a new grammar of the same kind: too costly), or it gave up waiting.
            p.check(EXPONENTIAL.replace('"z"', '"w"'))
        worker.join()
        assert isinstance(done[0], InvalidArgument)
    finally:
        p.close()


def _record(out: list[BaseException | None], p: GrammarProbe, grammar: str) -> None:
    try:
        p.check(grammar)
        out.append(None)
    except BaseException as e:
        out.append(e)


def test_the_engine_refuses_a_hostile_grammar_and_keeps_serving(tiny_model: Path) -> None:
    with Engine(str(tiny_model), OPTS) as e:
        t0 = time.perf_counter()
        with pytest.raises(InvalidArgument, match="too costly"):
            e.generate("g", "p", [M("user", "hi")], GREEDY.merged(grammar=EXPONENTIAL))
        assert time.perf_counter() - t0 < 5.0
        assert e.generate("ok", "p", [M("user", "hi")], GREEDY).result().usage is not None
        assert e.alive and not e.known("g")


# -- signed blobs ---------------------------------------------------------------------------
def _exported(e: Engine, sid: str, text: str) -> bytes:
    e.generate(sid, "p", [M("user", text)], GREEDY).result()
    while e.stats().active_requests:
        time.sleep(0.01)
    return e.export_session(sid, "p")


def _unsigned_body(blob: bytes) -> bytes:
    return blob[: -8 - 32]


def _resign(body: bytes, keys: BlobKeys) -> bytes:
    return body + keys.sign(body)


def test_only_blobs_signed_by_a_fleet_key_load(tiny_model: Path) -> None:
    with Engine(str(tiny_model), OPTS, blob_keys=KEYS) as a:
        blob = _exported(a, "s", "hello there")
    other_fleet = BlobKeys([b"another fleet's key, 32 bytes!!"])
    with Engine(str(tiny_model), OPTS, blob_keys=other_fleet) as b:
        with pytest.raises(InvalidArgument, match="signature does not match"):
            b.import_session("t", "p", blob)
        assert not b.known("t")
    # A plain checksum (the old format) anyone can recompute is refused outright.
    body = b"HOTLOOP-SESSION\x01" + _unsigned_body(blob)[len(MAGIC) :]
    with Engine(str(tiny_model), OPTS, blob_keys=KEYS) as c, pytest.raises(InvalidArgument, match="older, unsigned"):
        c.import_session("u", "p", body + hashlib.sha256(body).digest())
    # Rotation: a new key signs, the old one still verifies.
    rotated = BlobKeys([b"the new key of this fleet, 32 b!", b"this fleet's export key, 32 bytes"])
    with Engine(str(tiny_model), OPTS, blob_keys=rotated) as d:
        assert d.import_session("v", "p", blob).context_tokens > 0
        again = d.export_session("v", "p")
    with Engine(str(tiny_model), OPTS, blob_keys=KEYS) as old_only, pytest.raises(InvalidArgument, match="signature"):
        old_only.import_session("w", "p", again)


def _repack(
    blob: bytes, tokens: list[int] | None = None, kv: bytes | None = None, header: bytes | None = None
) -> bytes:
    """A blob with its parts replaced, re-signed with the fleet's key: what an insider (or a bug)
    could produce, caught by the consistency check, not the signature."""
    parsed = SessionBlob.decode(blob, _fingerprint_of(blob), KEYS)
    tokens = parsed.tokens if tokens is None else tokens
    kv = parsed.kv if kv is None else kv
    if header is None:
        header = json.dumps(
            {
                "fingerprint": parsed.fingerprint,
                "owner": "",
                "n_tokens": len(tokens),
                "kv_bytes": len(kv),
                "settings": settings_to_dict(parsed.settings),
            }
        ).encode()
    body = MAGIC + struct.pack("<I", len(header)) + header + struct.pack(f"<{len(tokens)}i", *tokens) + kv
    return _resign(body, KEYS)


def _fingerprint_of(blob: bytes) -> str:
    (hlen,) = struct.unpack_from("<I", blob, len(MAGIC))
    return str(json.loads(blob[len(MAGIC) + 4 : len(MAGIC) + 4 + hlen])["fingerprint"])


@pytest.mark.parametrize("model", ["tiny", "gemma"])
def test_inconsistent_kv_states_are_refused_before_llama_cpp(model: str, tiny_model: Path, gemma_model: Path) -> None:
    path = tiny_model if model == "tiny" else gemma_model
    with Engine(str(path), OPTS, blob_keys=KEYS) as e:
        short = _exported(e, "short", "a short chat")
        long = _exported(e, "long", "a much longer chat about the sea, the wind and the boats " * 12)
        p_short, p_long = (SessionBlob.decode(b, e.fingerprint, KEYS) for b in (short, long))
        forged = {
            "long tokens over short KV": _repack(short, tokens=p_long.tokens),
            "short tokens over long KV": _repack(long, tokens=p_short.tokens),
            "one token more": _repack(short, tokens=[*p_short.tokens, p_short.tokens[-1]]),
            "KV cut short": _repack(short, kv=p_short.kv[: len(p_short.kv) // 2]),
            "KV with trailing bytes": _repack(short, kv=p_short.kv + b"\0" * 64),
            "positions shifted": _repack(short, kv=_shift_positions(p_short.kv, 3)),
            "a layer's row size changed": _repack(short, kv=_bump_first_row_size(p_short.kv)),
            "not a state": _repack(short, kv=b"\x01" * len(p_short.kv)),
            "header nested 100,000 deep": _repack(short, header=b"[" * 100_000 + b"]" * 100_000),
        }
        for case, blob in forged.items():
            t0 = time.perf_counter()
            with pytest.raises(InvalidArgument) as info:
                e.import_session(f"x-{len(case)}", "p", blob)
            assert time.perf_counter() - t0 < 2.0, case
            assert not e.known(f"x-{len(case)}"), case
            assert "RecursionError" not in info.value.message
        # The genuine blobs still load, and the engine serves on.
        assert e.import_session("copy", "p", long).context_tokens == len(p_long.tokens)
        reply = e.generate("copy", "p", [M("user", "the wind"), M("assistant", "x"), M("user", "go")], GREEDY)
        assert reply.result().usage is not None and e.alive
        with pytest.raises(FailedPrecondition):
            e.import_session("copy", "p", long)


def _cells(kv: bytes) -> tuple[int, int]:
    """(offset of the first cell record, cell count) of the first cache of a one-stream state."""
    magic, _seq, streams, count = struct.unpack_from("<IiII", kv, 0)
    assert magic == STATE_MAGIC and streams == 1
    return 16, count


def _shift_positions(kv: bytes, by: int) -> bytes:
    offset, count = _cells(kv)
    out = bytearray(kv)
    cells = np.frombuffer(out, np.dtype([("pos", "<i4"), ("n", "<u4"), ("seq", "<i4")]), count, offset)
    cells["pos"] += by
    return bytes(out)


def _bump_first_row_size(kv: bytes) -> bytes:
    offset, count = _cells(kv)
    at = offset + count * 12 + 8 + 4  # past the cells, v_trans, layers, and the first key type
    out = bytearray(kv)
    (row,) = struct.unpack_from("<Q", out, at)
    struct.pack_into("<Q", out, at, row + 2)
    return bytes(out)


def test_check_state_accepts_what_the_engine_exports(gemma_model: Path) -> None:
    with Engine(str(gemma_model), OPTS, blob_keys=KEYS) as e:
        for words in (3, 300):  # 300 words: past Gemma's 512-token window, two caches differ
            blob = SessionBlob.decode(_exported(e, f"s{words}", "word " * words), e.fingerprint, KEYS)
            layout = e._memory.layout
            assert layout is not None and len(layout.caches) == 2
            check_state(blob.kv, len(blob.tokens), layout)


# -- quotas ---------------------------------------------------------------------------------
def test_unfinished_imports_are_bounded_per_caller_and_per_replica() -> None:
    now = [0.0]
    imports = PendingImports(per_caller=3 << 20, per_replica=5 << 20, ttl_s=60.0, clock=lambda: now[0])
    part = b"x" * (1 << 20)
    for i in range(3):
        assert imports.add(("a", f"k{i}"), "a", 0, part, 10 << 20) is None
    with pytest.raises(ResourceExhausted, match="import_bytes_per_principal"):
        imports.add(("a", "k3"), "a", 0, part, 10 << 20)
    assert imports.add(("b", "k0"), "b", 0, part, 10 << 20) is None
    assert imports.add(("b", "k1"), "b", 0, part, 10 << 20) is None
    with pytest.raises(ResourceExhausted, match="import_bytes_per_replica"):
        imports.add(("c", "k0"), "c", 0, part, 10 << 20)
    assert imports.held() == 5 << 20
    now[0] = 61.0  # they expire
    assert imports.add(("c", "k0"), "c", 0, part, 2 << 20) is None
    assert imports.held() == 1 << 20
    assert imports.add(("c", "k0"), "c", 1 << 20, part, 2 << 20) == part + part
    assert imports.held() == 0


def test_anonymous_sessions_are_counted_by_address() -> None:
    live: set[str] = set()
    quota = AnonymousSessions(per_caller=3, known=live.__contains__)
    me, other = caller_key("anonymous", "ipv4:10.0.0.7:5123"), caller_key("anonymous", "ipv6:[::1]:80")
    assert me == "anonymous@10.0.0.7" and other == "anonymous@::1"
    for i in range(3):
        quota.admit(me)
        quota.add(me, f"s{i}")
        live.add(f"s{i}")
    with pytest.raises(ResourceExhausted, match=r"10\.0\.0\.7 already hold 3 sessions"):
        quota.admit(me)
    quota.admit(other)  # another address is not held back
    quota.admit(caller_key("alice", "ipv4:10.0.0.7:1"))  # principals count in the engine
    live.discard("s0")  # closed or expired: room again
    quota.admit(me)


def test_export_keys_come_first_and_short_ones_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from hotloop_serve.config import AuthConfig
    from hotloop_serve.serve.auth import export_secrets

    monkeypatch.delenv("HOTLOOP_EXPORT_KEYS", raising=False)
    assert export_secrets(AuthConfig(), "the-session-secret-0123") == [b"the-session-secret-0123"]
    monkeypatch.setenv("HOTLOOP_EXPORT_KEYS", " new-key-0123456789, old-key-0123456789 ")
    secrets_ = export_secrets(AuthConfig(), "the-session-secret-0123")
    assert secrets_ == [b"new-key-0123456789", b"old-key-0123456789", b"the-session-secret-0123"]
    signed_by_old = BlobKeys.derived([b"old-key-0123456789"])
    body = MAGIC + b"anything"
    assert BlobKeys.derived(secrets_).verify(body + signed_by_old.sign(body))
    monkeypatch.setenv("HOTLOOP_EXPORT_KEYS", "short")
    with pytest.raises(ValueError, match="at least 16 characters"):
        export_secrets(AuthConfig(), "the-session-secret-0123")
