import json

from inferd.gateway.proxy import TokenTally


def event(payload: dict) -> bytes:
    return f"data: {json.dumps(payload)}\n\n".encode()


def delta(**fields) -> bytes:  # noqa: ANN003
    return event({"choices": [{"index": 0, "delta": fields}]})


USAGE = {"prompt_tokens": 9, "completion_tokens": 3, "total_tokens": 12}
STREAM = (
    delta(role="assistant")
    + delta(content="Hel")
    + b": keep-alive\n\n"
    + delta(content="lo")
    + delta(content="!")
    + event({"choices": [], "usage": USAGE})
    + b"data: [DONE]\n\n"
)


def test_counts_one_per_event_with_content():
    tally = TokenTally()

    assert tally.feed(delta(content="a") + delta(content="b")) == 2
    assert tally.counted == 2


def test_counts_completion_text_events():
    tally = TokenTally()

    assert tally.feed(event({"choices": [{"index": 0, "text": "x"}]})) == 1
    assert tally.feed(event({"choices": [{"index": 0, "text": ""}]})) == 0


def test_counts_reasoning_content():
    assert TokenTally().feed(delta(reasoning_content="hmm")) == 1


def test_role_only_first_chunk_counts_nothing():
    tally = TokenTally()

    assert tally.feed(delta(role="assistant")) == 0
    assert tally.feed(delta(content="")) == 0
    assert tally.counted == 0


def test_usage_event_sets_usage():
    tally = TokenTally()

    assert tally.feed(event({"choices": [], "usage": USAGE})) == 0
    assert tally.usage == USAGE


def test_done_and_comments_are_ignored():
    tally = TokenTally()

    assert tally.feed(b": ping\n\ndata: [DONE]\n\n") == 0
    assert (tally.counted, tally.usage, tally.mid_event) == (0, None, False)


def test_whole_stream_in_one_piece():
    tally = TokenTally()

    assert tally.feed(STREAM) == 3
    assert tally.usage == USAGE
    assert tally.mid_event is False


def test_stream_split_byte_by_byte_counts_each_event_once():
    tally = TokenTally()

    added = sum(tally.feed(STREAM[i:i + 1]) for i in range(len(STREAM)))

    assert added == 3
    assert tally.counted == 3
    assert tally.usage == USAGE


def test_event_split_at_its_blank_line_counts_once():
    tally = TokenTally()
    chunk = delta(content="x")

    assert tally.feed(chunk[:-1]) == 0
    assert tally.feed(chunk[-1:]) == 1
    assert tally.counted == 1


def test_mid_event_while_a_partial_event_is_buffered():
    tally = TokenTally()
    chunk = delta(content="x")

    assert tally.mid_event is False
    tally.feed(chunk[:10])
    assert tally.mid_event is True
    tally.feed(chunk[10:])
    assert tally.mid_event is False
    tally.feed(chunk + chunk[:5])
    assert tally.mid_event is True
