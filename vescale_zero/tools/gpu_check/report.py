"""What a section of the GPU check hands back, and the report made of them (markdown and JSON)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List

__all__ = ["STATUSES", "Outcome", "render_markdown", "render_json", "one_line"]

STATUSES = ("PASS", "FAIL", "SKIP")


@dataclass
class Outcome:
    """One section's result. ``summary``: one line for the report's table (for a FAIL or SKIP,
    its cause); ``lines``: markdown under the section's heading (tables of figures); ``figures``:
    the same figures for the JSON; ``seconds``: the section's wall time, its process included."""

    name: str
    status: str
    summary: str
    lines: List[str] = field(default_factory=list)
    figures: Dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"status {self.status!r}: one of {STATUSES}")


def one_line(error: BaseException) -> str:
    """``Type: the first line of the message`` (at most 300 characters)."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:300] if text else ''}".rstrip(": ")


def render_markdown(env: Dict[str, Any], outcomes: List[Outcome], total_s: float, budget_s: float) -> str:
    """The report: the environment, one table row per section, then each section's figures."""
    lines = ["# vescale-zero GPU check", ""]
    lines += [f"- {key}: {value}" for key, value in env.items()]
    counts = {s: sum(o.status == s for o in outcomes) for s in STATUSES}
    lines += [f"- total: {total_s:.1f} s (budget {budget_s:.0f} s); "
              + ", ".join(f"{counts[s]} {s}" for s in STATUSES), ""]
    lines += ["| section | status | seconds | summary |", "|---|---|---:|---|"]
    lines += [f"| {o.name} | {o.status} | {o.seconds:.1f} | {o.summary.replace('|', '/')} |" for o in outcomes]
    for o in outcomes:
        if o.lines:
            lines += ["", f"## {o.name}: {o.status} ({o.seconds:.1f} s)", ""] + o.lines
    return "\n".join(lines) + "\n"


def render_json(env: Dict[str, Any], outcomes: List[Outcome], total_s: float, budget_s: float) -> str:
    return json.dumps({"env": env, "total_seconds": round(total_s, 1), "budget_seconds": budget_s,
                       "sections": [asdict(o) for o in outcomes]}, indent=1, default=str)
