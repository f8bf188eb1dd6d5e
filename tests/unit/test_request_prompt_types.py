"""gateway/request.py: token-id prompts are checked item by item (ints, not bools or floats) in one
C-level pass; the verdicts are those of the per-item check."""

from __future__ import annotations

import pytest

from orchestrator.errors import InvalidRequest
from orchestrator.gateway import request as rq


@pytest.mark.parametrize("prompt", [
    list(range(8000)), [0], [2**40, 5], [[1, 2], [3]], [[1, 2], []], ["a", "b"], "text",
])
def test_valid_prompts(prompt):
    assert rq.validate(rq.COMPLETIONS, {"model": "m", "prompt": prompt}) == "m"


@pytest.mark.parametrize("prompt", [
    [1, True], [1, 2.0], [1, "2"], [1, None], [[1, 2], [3, False]], [[1], [2.5]], [[1], 2], ["a", 1],
    [True], [1.0, 2],
])
def test_mixed_or_invalid_items_are_refused_naming_the_field(prompt):
    with pytest.raises(InvalidRequest) as e:
        rq.validate(rq.COMPLETIONS, {"model": "m", "prompt": prompt})
    assert e.value.param == "prompt"


def test_a_bad_message_is_named_by_its_index():
    with pytest.raises(InvalidRequest) as e:
        rq.validate(rq.CHAT, {"model": "m", "messages": [{"role": "user", "content": "x"}, {"content": "y"}]})
    assert e.value.param == "messages[1].role"
