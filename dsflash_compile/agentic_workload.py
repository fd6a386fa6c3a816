"""A synthetic agentic workload (issue 7; BENCHMARKS.md): multi-turn sessions whose prompts grow turn by turn.

Shaped after the AgentX traces vLLM reports on (replayed coding-agent sessions: median 43 turns, median
142K input and 444 output tokens per request, > 95% prefix-cache hits):
  - every session starts with one system prefix shared by all sessions (a long tool/system prompt);
  - turn 1 adds the session's first user text; every later turn's prompt is the previous prompt, the
    previous answer and new text (a tool result or a user message), so a prompt extends the last one;
  - answers are short next to the prompts.
Turn counts, new-text and answer lengths are drawn from log-normal distributions around their medians
(seeded), so a run is reproducible. With the defaults and 64 sessions: median 45 turns, median 142K input
tokens per request (p90 341K), 97% prefix hits (see workload_stats). `scale` shrinks every length for CPU runs. Token ids are random (the
model's outputs replace the planned answers when the workload is served; the plan fixes their lengths).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch

from .benchmarking import percentiles


@dataclass(frozen=True)
class WorkloadConfig:
    sessions: int = 16
    median_turns: int = 43
    system_prefix: int = 16384  # tokens shared by every session
    first_user: int = 2048  # the first turn's own text
    median_new_tokens: int = 4096  # text added per later turn (tool output, user message)
    median_output: int = 444  # answer tokens per turn
    spread: float = 0.5  # sigma of the log-normal draws
    vocab_size: int = 129280
    seed: int = 0
    scale: float = 1.0  # multiplies every length (e.g. 1/256 for the tiny preset on a CPU)

    def __post_init__(self):
        for name in ("sessions", "median_turns", "system_prefix", "first_user", "median_new_tokens",
                     "median_output", "vocab_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"WorkloadConfig.{name} must be >= 1, got {getattr(self, name)}")
        if not 0 < self.scale <= 1:
            raise ValueError(f"WorkloadConfig.scale must be in (0, 1], got {self.scale}")

    def scaled(self, n: int) -> int:
        """A length of the unscaled workload at this scale (at least 1 token)."""
        return max(1, round(n * self.scale))

    @property
    def system_tokens(self) -> int:
        """Length of the system prefix every session starts with."""
        return self.scaled(self.system_prefix)


@dataclass
class Turn:
    new_tokens: list[int]  # appended to the previous prompt and answer
    output_len: int  # answer length to generate


@dataclass
class Session:
    index: int
    first: list[int]  # the shared system prefix, then the session's first user text
    turns: list[Turn] = field(default_factory=list)

    def planned_prompts(self, filler: int = 3) -> list[list[int]]:
        """Each turn's prompt if every answer were `output_len` copies of `filler` (for statistics; serving
        appends the real answers instead)."""
        prompts, prompt = [], list(self.first)
        for i, turn in enumerate(self.turns):
            if i:
                prompt = prompt + [filler] * self.turns[i - 1].output_len + turn.new_tokens
            prompts.append(prompt)
        return prompts


def _lognormal(gen: torch.Generator, median: float, spread: float, minimum: int = 1) -> int:
    return max(minimum, round(median * math.exp(spread * torch.randn((), generator=gen).item())))


def make_workload(config: WorkloadConfig) -> list[Session]:
    gen = torch.Generator().manual_seed(config.seed)

    def tokens(n: int) -> list[int]:
        return torch.randint(3, config.vocab_size, (n,), generator=gen).tolist()

    system = tokens(config.system_tokens)
    sessions = []
    for index in range(config.sessions):
        session = Session(index, system + tokens(config.scaled(config.first_user)))
        for turn in range(_lognormal(gen, config.median_turns, config.spread)):
            new = [] if turn == 0 else tokens(_lognormal(gen, config.scaled(config.median_new_tokens), config.spread))
            session.turns.append(Turn(new, _lognormal(gen, config.scaled(config.median_output), config.spread)))
        sessions.append(session)
    return sessions


def workload_stats(config: WorkloadConfig, sessions: list[Session]) -> dict:
    """Turns per session, input and output tokens per request, and the prefix-hit rate: the share of
    prompt tokens already seen as a prefix (the previous turn's prompt and answer, or the shared system
    prefix for a later session's first turn). An upper bound on what a prefix cache serves: the cache
    rounds a hit down to whole blocks and needs it longer than the window."""
    turns, inputs, outputs, reused, total = [], [], [], 0, 0
    system = config.system_tokens
    for session in sessions:
        prompts = session.planned_prompts()
        turns.append(len(prompts))
        for i, (prompt, turn) in enumerate(zip(prompts, session.turns)):
            inputs.append(len(prompt))
            outputs.append(turn.output_len)
            total += len(prompt)
            if i:
                reused += len(prompts[i - 1]) + session.turns[i - 1].output_len
            elif session.index:
                reused += system
    return {"config": asdict(config), "sessions": len(sessions), "requests": len(inputs),
            "turns": percentiles(turns), "input_tokens": percentiles(inputs), "output_tokens": percentiles(outputs),
            "prefix_hit_rate": reused / total}
