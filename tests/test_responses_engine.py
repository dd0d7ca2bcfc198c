"""A conversation through the Responses API on real engines (the run's shared platform, harness.engines): each turn
continued by previous_response_id is rebuilt from the store and rendered with the chat template, so its prompt starts
with the previous turn's prompt and answer; routed by that prefix, it goes to the pool whose engine holds the history,
and the engine reads it from its prefix cache (usage.input_tokens_details.cached_tokens)."""

from __future__ import annotations

import pytest
from harness.engines import KEY, PUBLIC
from harness.openai_schema import assert_openai_shape
from openai.types.responses import Response

pytestmark = pytest.mark.engine

HISTORY = ("The library opens at nine in the morning and closes at six in the evening on weekdays. On Saturdays it "
           "opens at ten and closes at four, and on Sundays it stays closed. Members may borrow up to five books at a "
           "time for three weeks, and renew each loan twice unless another member has reserved the book. ")


def test_a_three_turn_conversation_reads_its_history_from_the_prefix_cache(platform):
    client = platform.client(KEY)
    turns, previous = [], None
    for text, output in ((HISTORY + "When does it open on Saturdays?", 8), ("And on Sundays?", 8), ("How many books?", 8)):
        raw = client.responses.with_raw_response.create(model=PUBLIC, input=text, max_output_tokens=output,
                                                        previous_response_id=previous, temperature=0)
        resp = assert_openai_shape(raw.http_response.json(), Response)
        turns.append((resp, raw.headers["x-swiftkv-route"]))
        previous = resp.id
    (first, first_route), *later = turns
    pool = first_route.split(";")[0]
    for resp, route in later:
        # the history is a prefix of this turn's prompt (prompt-heavy turns: the pool that holds it is also the ratio's
        # choice, so the route does not depend on the prefix index's floor, routing.prefix_min_distinct_tokens), and the
        # engine reads it from its prefix cache
        assert route.startswith(pool + ";"), (first_route, route)
        assert resp.usage.input_tokens > first.usage.input_tokens
        assert resp.usage.input_tokens_details.cached_tokens > 0, resp.usage
