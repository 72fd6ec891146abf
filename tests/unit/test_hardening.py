"""Serve-side hardening without a server: session ids answer any string, auth fails closed,
several replicas need a session secret (issue 12)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from hotloop_serve.config import AuthConfig, config_from_dict
from hotloop_serve.errors import InvalidArgument, NotFound, Unauthenticated
from hotloop_serve.serve.app import preflight, session_secret
from hotloop_serve.serve.auth import MIN_TOKEN_LENGTH, Authenticator, describe_tokens, is_local_peer, load_tokens
from hotloop_serve.serve.declarative import deploy
from hotloop_serve.serve.session_ids import SessionIds

ALICE = "alice-token-0123456789"
ALICE_NEXT = "alice-token-rotated-0123"
BOB = "bob-token-0123456789"


# -- session ids ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "session_id",
    [
        "",
        ".",
        "ünïcødé-key.sig",  # non-ASCII key
        "abcdefgh.ßig-non-ascii",  # non-ASCII signature: hmac.compare_digest(str) raised TypeError
        "abcdefgh\n.sig",
        "a" * 10_000 + ".x",
        "abcdefgh.\x00\x01",
    ],
)
def test_any_session_id_is_not_found_never_an_error(session_id: str) -> None:
    with pytest.raises(NotFound):
        SessionIds(b"k", "m").verify(session_id, "alice")


@pytest.mark.parametrize("key", ["abcdefgh\n", "abcdefg", "x" * 65, "abc defgh", "clé-12345"])
def test_session_keys_are_matched_whole(key: str) -> None:
    with pytest.raises(InvalidArgument, match="session_key"):
        SessionIds(b"k", "m").new("alice", key)


def test_a_valid_id_verifies_for_its_principal_only() -> None:
    ids = SessionIds(b"k", "m")
    sid = ids.new("alice", "abcdefgh")
    assert ids.verify(sid, "alice") == sid
    with pytest.raises(NotFound):
        ids.verify(sid, "bob")
    with pytest.raises(NotFound):
        SessionIds(b"other", "m").verify(sid, "alice")


# -- auth ----------------------------------------------------------------------------------


def test_a_principal_may_hold_several_tokens(tmp_path: Path) -> None:
    file = tmp_path / "tokens"
    file.write_text(f"# rotation: both work until the old one is removed\nalice:{ALICE}\nalice:{ALICE_NEXT}\n")
    tokens = load_tokens(AuthConfig(tokens={"bob": BOB}, tokens_file=str(file)))
    assert tokens == {"bob": (BOB,), "alice": (ALICE, ALICE_NEXT)}
    auth = Authenticator(tokens)
    for token in (ALICE, ALICE_NEXT):
        assert auth.principal([("authorization", f"Bearer {token}")]) == "alice"
    assert describe_tokens(tokens) == "auth on: 2 principal(s), 3 token(s)"
    assert describe_tokens({}) == "auth off: anonymous callers accepted from this machine only"


@pytest.mark.parametrize("content", ["", "\n# only a comment\n"])
def test_an_empty_token_file_refuses_to_start(tmp_path: Path, content: str) -> None:
    file = tmp_path / "tokens"
    file.write_text(content)
    with pytest.raises(ValueError, match=r"auth.tokens_file .* holds no 'principal:token' entry"):
        load_tokens(AuthConfig(tokens_file=str(file)))


def test_a_missing_token_file_refuses_to_start(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"auth.tokens_file .*missing.* cannot be read"):
        load_tokens(AuthConfig(tokens_file=str(tmp_path / "missing")))


def test_an_unset_or_empty_token_variable_refuses_to_start(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HOTLOOP_TEST_TOKENS", raising=False)
    with pytest.raises(ValueError, match=r"\$HOTLOOP_TEST_TOKENS\) is not set"):
        load_tokens(AuthConfig(tokens_env="HOTLOOP_TEST_TOKENS"))
    monkeypatch.setenv("HOTLOOP_TEST_TOKENS", " , ")
    with pytest.raises(ValueError, match=r"\$HOTLOOP_TEST_TOKENS\) holds no"):
        load_tokens(AuthConfig(tokens_env="HOTLOOP_TEST_TOKENS"))
    monkeypatch.setenv("HOTLOOP_TEST_TOKENS", f"alice:{ALICE},bob:{BOB}")
    assert set(load_tokens(AuthConfig(tokens_env="HOTLOOP_TEST_TOKENS"))) == {"alice", "bob"}


def test_short_and_shared_tokens_are_refused() -> None:
    with pytest.raises(ValueError, match=f"'alice' has 5 characters; at least {MIN_TOKEN_LENGTH}"):
        load_tokens(AuthConfig(tokens={"alice": "short"}))
    with pytest.raises(ValueError, match="one token is given to both 'alice' and 'bob'"):
        load_tokens(AuthConfig(tokens={"alice": ALICE, "bob": ALICE}))


def test_repeated_entries_are_reported(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    file = tmp_path / "tokens"
    file.write_text(f"alice:{ALICE}\n")
    with caplog.at_level(logging.WARNING):
        tokens = load_tokens(AuthConfig(tokens={"alice": ALICE}, tokens_file=str(file)))
    assert tokens == {"alice": (ALICE,)}
    assert "repeats a token of 'alice'" in caplog.text
    assert ALICE not in caplog.text


@pytest.mark.parametrize(
    ("peer", "local"),
    [
        ("ipv4:127.0.0.1:5000", True),
        ("ipv4:127.8.9.10:1", True),
        ("ipv6:[::1]:5000", True),
        ("ipv6:[::ffff:127.0.0.1]:5000", True),
        ("unix:/tmp/sock", True),
        ("ipv4:10.1.2.3:5000", False),
        ("ipv6:[2001:db8::1]:443", False),
        ("ipv6:[::ffff:10.0.0.1]:5000", False),
        ("garbage", False),
        ("ipv4:not-an-ip:1", False),
    ],
)
def test_anonymous_calls_are_accepted_from_this_machine_only(peer: str, local: bool) -> None:
    assert is_local_peer(peer) is local
    if local:
        assert Authenticator({}).principal([], peer) == "anonymous"
    else:
        with pytest.raises(Unauthenticated, match=r"auth\.anonymous: network"):
            Authenticator({}).principal([], peer)
    # Said in so many words, the network is served too; with tokens, the peer does not matter.
    assert Authenticator({}, anonymous="network").principal([], peer) == "anonymous"
    assert Authenticator({"alice": ALICE}).principal([("authorization", f"Bearer {ALICE}")], peer) == "alice"


def test_no_source_means_auth_off() -> None:
    assert load_tokens(AuthConfig()) == {}
    assert Authenticator({}).principal([]) == "anonymous"
    with pytest.raises(Unauthenticated):
        Authenticator({"alice": ALICE}).principal([("authorization", "Bearer ünï")])


# -- session secret ------------------------------------------------------------------------


def test_several_replicas_without_a_secret_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HOTLOOP_SESSION_SECRET", raising=False)
    one = config_from_dict({"models": [{"name": "a"}]})
    assert len(session_secret(one)) >= 32  # one replica, one process: a fresh key is fine
    for model in ({"name": "b", "replicas": 2}, {"name": "c", "autoscaling": {"min_replicas": 1, "max_replicas": 3}}):
        config = config_from_dict({"models": [model]})
        with pytest.raises(ValueError, match=r"HOTLOOP_SESSION_SECRET"):
            session_secret(config)
        with pytest.raises(ValueError, match=model["name"]):
            preflight(config)
        with pytest.raises(ValueError, match=model["name"]):  # before anything reaches Ray
            deploy(config)
    monkeypatch.setenv("HOTLOOP_SESSION_SECRET", "s" * 40)
    assert session_secret(config_from_dict({"models": [{"name": "b", "replicas": 2}]})) == "s" * 40


def test_the_proxy_message_limit_follows_the_request_limit() -> None:
    from hotloop_serve.serve.app import PROXY_MESSAGE_SLACK, proxy_message_limit, replica_message_limit

    config = config_from_dict(
        {"models": [{"name": "a", "limits": {"max_request_bytes": 1 << 20}}, {"name": "b"}]}
    )  # b keeps the default 4 MiB
    assert proxy_message_limit(config) == (4 << 20) + PROXY_MESSAGE_SLACK
    assert replica_message_limit(config) == proxy_message_limit(config) + PROXY_MESSAGE_SLACK
