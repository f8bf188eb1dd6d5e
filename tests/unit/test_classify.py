"""Who caused a failure (orchestrator/gateway/classify.py): pure decisions, no sockets."""

from orchestrator.gateway.classify import GARBAGE, SecondOpinion, engine_error, error_in_answer, retry_after


def test_a_200_carrying_an_error_is_that_error():
    assert error_in_answer({"error": {"message": "m", "code": 400}}) == (400, {"message": "m", "code": 400})
    assert error_in_answer({"object": "error", "message": "bad", "code": 503})[0] == 503
    assert error_in_answer({"error": {"message": "no code"}})[0] == 502  # not an HTTP status: a bad gateway
    assert error_in_answer({"error": "just text"}) == (502, {"message": "just text"})
    assert error_in_answer({"choices": []}) is None and error_in_answer([1]) is None


def test_engine_errors_keep_message_type_param_and_code():
    e = engine_error(400, b'{"object": "error", "message": "too long", "type": "BadRequestError", "code": 400}')
    assert (e.status, e.message, e.type, e.code) == (400, "too long", "BadRequestError", 400)
    g = engine_error(500, b"<html>oops</html>")
    assert g.status == 500 and "oops" in g.message


def test_a_5xx_is_the_workers_unless_a_second_worker_gives_the_same():
    j = SecondOpinion()
    j.hold("a", 500)
    assert j.same_again(500) and not j.same_again(503)
    assert j.settle(request_caused=True) == [] and j.pending == []  # the request: nobody is blamed
    j.hold("a", 500)
    assert j.settle(request_caused=False) == [("a", 500)]  # another worker answered: a was at fault


def test_garbage_is_judged_like_a_5xx_and_apart_from_it():
    j = SecondOpinion()
    j.hold("a", GARBAGE)
    assert j.same_again(GARBAGE) and not j.same_again(500)  # garbage again: the request; a 5xx: another story
    j.hold("b", 502)
    assert j.settle(request_caused=False) == [("a", GARBAGE), ("b", 502)]


def test_retry_after_keeps_the_engines_delta_seconds_only():
    assert retry_after(b" 3 ", 1) == "3"
    assert retry_after(None, 1) == "1"
    assert retry_after(b"Wed, 21 Oct 2026 07:28:00 GMT", 2) == "2"  # an HTTP date: the gateway's own
    assert retry_after(b"9" * 40, 2) == "2" and retry_after(b"-1", 2) == "2" and retry_after(b"\xff", 2) == "2"
