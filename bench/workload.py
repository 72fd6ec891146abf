"""A deterministic multi-session chat workload, shared by every system a benchmark compares.

Why a generator and not a fixed corpus: the figures that matter for a session-oriented
server (follow-up time-to-first-token, tokens/s under concurrency) depend on the *shape*
of the conversation (a long first turn, short follow-ups, the previous reply appended to
the history every turn), not on what the text says. Generating the text from a fixed seed
gives every system byte-identical user turns, lets ``--quick`` shrink the shape without a
second corpus, and keeps the repository free of data files.

The workload only describes user turns; the assistant turns are each system's own replies,
appended as they come back (a chat client resends the whole history every turn). Roles are
plain strings (``"system"``, ``"user"``, ``"assistant"``) so that the same history feeds the
OpenAI-style peer and the hotloop SDK.

Gemma's chat template has no system role. hotloop's Gemma template folds the system prompt
into the first user turn itself; llama-cpp-python's ``gemma`` chat format silently drops
system messages, so :func:`merge_system_prompt` folds it the same way (``system + "\\n\\n" +
first user message``) before a request goes to the peer: both systems then see the same
prompt text.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

Turn = tuple[str, str]
"""``(role, content)``: role is ``"system"``, ``"user"`` or ``"assistant"``."""

SYSTEM_PROMPT = (
    "You are a concise research assistant. Answer in plain prose, in at most three sentences, "
    "and ground every answer in the notes the user shares. If the notes do not say, say so."
)
"""Shared by every session (as a real deployment's system prompt would be)."""

# Word lists for the sentence generator: varied enough that no two paragraphs repeat, plain
# enough that the tokenizer sees ordinary English (about 1.3 Gemma tokens per word).
_TOPICS = (
    "tidal energy",
    "urban beekeeping",
    "medieval shipbuilding",
    "soil microbiology",
    "railway signalling",
    "glacier retreat",
    "coffee fermentation",
    "bridge inspection",
    "river restoration",
    "paper conservation",
    "wind tunnel testing",
    "coral reef monitoring",
    "bread chemistry",
    "satellite navigation",
    "forest fire ecology",
    "vaccine cold chains",
)
_SUBJECTS = (
    "the survey team",
    "a small pilot study",
    "the field engineers",
    "most of the samples",
    "the older records",
    "an independent review",
    "the regional office",
    "the second prototype",
    "several local volunteers",
    "the control group",
    "the maintenance crew",
    "a follow-up analysis",
    "the early measurements",
    "the project budget",
    "the funding agency",
    "the monitoring station",
)
_VERBS = (
    "reported",
    "underestimated",
    "confirmed",
    "questioned",
    "documented",
    "predicted",
    "measured",
    "revised",
    "compared",
    "recorded",
    "traced",
    "reconstructed",
    "estimated",
    "challenged",
    "summarised",
    "tested",
)
_OBJECTS = (
    "a seasonal pattern in the results",
    "the cost of routine repairs",
    "the effect of higher temperatures",
    "a gradual decline in output",
    "the role of local suppliers",
    "an unexpected rise in failures",
    "the influence of heavy rainfall",
    "the accuracy of the old instruments",
    "a link between age and wear",
    "the time needed for each inspection",
    "the share of imported materials",
    "a steady gain in efficiency",
    "the impact of the new regulations",
    "the number of skilled workers",
    "a drop in energy use",
    "the quality of the archived data",
)
_CLAUSES = (
    "although the sample was small",
    "after two years of delays",
    "despite a shortage of equipment",
    "because the earlier method was unreliable",
    "while the weather stayed unusually dry",
    "once the new sensors were installed",
    "even though nobody expected it",
    "before the final audit began",
    "as the winter season approached",
    "when the data were checked again",
    "unless the trend reverses soon",
    "since the original plans were lost",
)
_ADVERBS = ("carefully", "quickly", "repeatedly", "independently", "cautiously", "briefly", "openly", "jointly")
_FOLLOWUPS = (
    "What does the note say about {obj}?",
    "Why did {subj} matter so much here?",
    "Summarise the part about {obj} in one sentence.",
    "Is there any evidence that contradicts what {subj} found?",
    "How would you explain {obj} to a newcomer?",
    "Which finding about {topic} seems least certain, and why?",
    "What should the next study of {topic} measure first?",
    "Does anything in the notes explain {obj}?",
)


@dataclass(frozen=True)
class WorkloadSpec:
    """The shape of the workload; the defaults are the benchmark's (see bench/README.md)."""

    sessions: int = 8
    """Concurrent chat sessions."""
    turns: int = 4
    """Turns per session; turn 1 carries the long first message, turns >= 2 are follow-ups."""
    sample_len: int = 48
    """Maximum tokens generated per turn."""
    first_turn_words: int = 760
    """Words of notes in the first user message: about 1,000 Gemma tokens with the system prompt."""
    temperature: float = 0.7
    """Sampling temperature; each session has its own fixed seed (0 would mean greedy)."""
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    """Sampler settings sent explicitly to every system, so no server default differs."""
    seed: int = 20240611
    """Seed of the text generator and of the per-session sampling seeds."""
    arrival_rate: float = 0.0
    """Sessions arriving per second as a Poisson process (0: every session starts at once)."""
    think_s: float = 0.0
    """Mean think time before each follow-up, exponentially distributed (0: none)."""


@dataclass(frozen=True)
class SessionScript:
    """Everything one session sends, decided before the run: its user turns and its seed."""

    index: int
    seed: int
    topic: str
    system_prompt: str
    user_turns: tuple[str, ...]
    start_s: float = 0.0
    """When the session's first turn is sent, from the run's start (Poisson arrivals)."""
    think_s: tuple[float, ...] = ()
    """Pause before each follow-up (``think_s[i]`` before turn ``i + 2``)."""

    def history(self, turn: int, replies: Sequence[str]) -> list[Turn]:
        """The full history to send for ``turn`` (1-based), given the replies received so far.

        A chat client resends everything each turn; ``replies[i]`` is the assistant's answer
        to turn ``i + 1``. Replies are stripped because both chat templates trim contents.
        """
        if not 1 <= turn <= len(self.user_turns):
            raise ValueError(f"turn {turn} outside 1..{len(self.user_turns)}")
        if len(replies) < turn - 1:
            raise ValueError(f"turn {turn} needs {turn - 1} replies, got {len(replies)}")
        history: list[Turn] = [("system", self.system_prompt)]
        for i in range(turn):
            history.append(("user", self.user_turns[i]))
            if i < turn - 1:
                history.append(("assistant", replies[i].strip()))
        return history


@dataclass(frozen=True)
class Workload:
    """A spec and the session scripts it generated."""

    spec: WorkloadSpec
    sessions: tuple[SessionScript, ...] = field(default_factory=tuple)


def _sentence(rng: random.Random, topic: str) -> str:
    """One sentence from a few templates, so sentence lengths and structures vary."""
    subj, verb, obj = rng.choice(_SUBJECTS), rng.choice(_VERBS), rng.choice(_OBJECTS)
    form = rng.randrange(5)
    if form == 0:
        s = f"{subj} {verb} {obj}, {rng.choice(_CLAUSES)}"
    elif form == 1:
        s = f"{rng.choice(_CLAUSES)}, {subj} {rng.choice(_ADVERBS)} {verb} {obj}"
    elif form == 2:
        s = f"in the work on {topic}, {subj} {verb} {obj}"
    elif form == 3:
        s = f"{subj} {verb} {obj} and {rng.choice(_SUBJECTS)} later {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}"
    else:
        s = f"{subj} {verb} {obj}"
    return s[0].upper() + s[1:] + "."


def _notes(rng: random.Random, topic: str, words: int) -> str:
    """Paragraphs of 3-7 sentences until ``words`` words are written."""
    paragraphs: list[str] = []
    count = 0
    while count < words:
        sentences = [_sentence(rng, topic) for _ in range(rng.randint(3, 7))]
        paragraph = " ".join(sentences)
        paragraphs.append(paragraph)
        count += len(paragraph.split())
    return "\n\n".join(paragraphs)


def _followup(rng: random.Random, topic: str) -> str:
    """A short follow-up question (about 15 tokens), as users ask after a long first message."""
    return rng.choice(_FOLLOWUPS).format(obj=rng.choice(_OBJECTS), subj=rng.choice(_SUBJECTS), topic=topic)


def build_workload(spec: WorkloadSpec) -> Workload:
    """Generate every session's script from ``spec.seed``: same spec, same bytes, every run."""
    if spec.sessions < 1 or spec.turns < 1 or spec.sample_len < 1:
        raise ValueError("sessions, turns and sample_len must be >= 1")
    master = random.Random(spec.seed)
    timing = random.Random(spec.seed ^ 0x5EED)  # its own stream: arrivals never change the texts
    scripts: list[SessionScript] = []
    start = 0.0
    for i in range(spec.sessions):
        if spec.arrival_rate > 0 and i > 0:
            start += timing.expovariate(spec.arrival_rate)
        thinks = tuple(
            timing.expovariate(1.0 / spec.think_s) if spec.think_s > 0 else 0.0 for _ in range(spec.turns - 1)
        )
        rng = random.Random(master.getrandbits(64))
        topic = _TOPICS[i % len(_TOPICS)]
        first = (
            f"Here are my notes on {topic}. Read them carefully; I will ask you questions about them.\n\n"
            + _notes(rng, topic, spec.first_turn_words)
            + f"\n\nFirst question: what is the main point of these notes on {topic}?"
        )
        turns = [first] + [_followup(rng, topic) for _ in range(spec.turns - 1)]
        scripts.append(
            SessionScript(
                index=i,
                seed=master.randrange(1, 2**31),
                topic=topic,
                system_prompt=SYSTEM_PROMPT,
                user_turns=tuple(turns),
                start_s=start,
                think_s=thinks,
            )
        )
    return Workload(spec=spec, sessions=tuple(scripts))


def merge_system_prompt(history: Sequence[Turn]) -> list[Turn]:
    """Fold a leading system message into the first user message, as hotloop's Gemma template does.

    Needed for servers whose Gemma chat format drops system messages (llama-cpp-python's
    ``gemma``): without it the peer would answer without the system prompt and prefill
    fewer tokens than hotloop, which would flatter it.
    """
    if not history or history[0][0] != "system":
        return list(history)
    system = history[0][1].strip()
    rest = list(history[1:])
    if rest and rest[0][0] == "user":
        return [("user", f"{system}\n\n{rest[0][1].strip()}"), *rest[1:]]
    return [("user", system), *rest]


def describe(workload: Workload) -> str:
    """A one-line summary for logs and reports."""
    s = workload.spec
    return (
        f"{s.sessions} sessions x {s.turns} turns, first message ~{s.first_turn_words} words, "
        f"sample_len {s.sample_len}, temperature {s.temperature} (per-session seeds), seed {s.seed}"
        + (f", Poisson arrivals {s.arrival_rate:g}/s" if s.arrival_rate > 0 else "")
        + (f", think time mean {s.think_s:g} s" if s.think_s > 0 else "")
    )


if __name__ == "__main__":  # print one session's first two turns, to eyeball the text
    wl = build_workload(WorkloadSpec(sessions=2, turns=2))
    for turn in wl.sessions[0].history(2, ["(reply to turn 1)"]):
        print(f"--- {turn[0]}\n{turn[1]}\n")
