"""A sweep's repeats belong to the full suite; the quick subset keeps one case of each.

[Note: a sweep runs once in the quick subset]
A test swept over world sizes (or layouts, precisions) proves one behaviour at each point. The
quick subset (``pytest -m "not slow" tests``) is what a developer runs, and the CI matrix's
selection takes its tests from it (tests/conftest.py, [Note: what the CI matrix runs]): it keeps
one point of each sweep -- an odd world size where the sweep has one, as the odd sizes are where
uneven pieces and summation orders show -- and marks the others ``slow``; the full suite, on the
pinned torch, runs every point.
"""

from __future__ import annotations

from typing import Any, List, Sequence

import pytest

__all__ = ["sweep"]


def sweep(values: Sequence[Any], quick: Any) -> List[Any]:
    """``values`` for ``pytest.mark.parametrize`` (or a fixture's ``params``), every one but
    ``quick`` marked slow ([Note: a sweep runs once in the quick subset]); a tuple value is one
    case's arguments."""
    if quick not in values:
        raise ValueError(f"the quick case {quick!r} is not one of the sweep's values {list(values)!r}")
    return [v if v == quick else pytest.param(*(v if isinstance(v, tuple) else (v,)), marks=pytest.mark.slow)
            for v in values]
