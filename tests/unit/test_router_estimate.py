"""Prompt-length estimate used when no tokenizer is plugged in."""

from orchestrator.router.estimate import estimate_prompt_tokens


def test_chat_counts_text_of_all_messages_including_parts():
    body = {"messages": [{"role": "system", "content": "x" * 40},
                         {"role": "user", "content": [{"type": "text", "text": "y" * 40}, {"type": "image_url"}]}]}
    assert estimate_prompt_tokens("/v1/chat/completions", body) == 20


def test_completions_string_list_and_token_ids():
    assert estimate_prompt_tokens("/v1/completions", {"prompt": "z" * 400}) == 100
    assert estimate_prompt_tokens("/v1/completions", {"prompt": ["a" * 8, "b" * 8]}) == 4
    assert estimate_prompt_tokens("/v1/completions", {"prompt": [1, 2, 3]}) == 3
    assert estimate_prompt_tokens("/v1/completions", {"prompt": [[1, 2], [3]]}) == 3
    assert estimate_prompt_tokens("/v1/completions", {"prompt": ""}) == 1


def test_code_and_cjk_are_not_counted_as_four_chars_per_token():
    from orchestrator.router.estimate import estimate_text_tokens
    # reference counts from a BPE tokenizer of the GPT-4/Llama-3 family (cl100k): prose 10, code ~15, CJK ~15-20
    assert estimate_text_tokens("The quick brown fox jumps over the lazy dog.") in range(9, 12)
    code = "def foo(self, x):\n    return self.bar[x] + 1\n"
    assert estimate_text_tokens(code) in range(13, 19)
    assert len(code) // 4 < 12  # what chars/4 said
    cjk = "我们今天去公园散步，天气很好。"
    assert estimate_text_tokens(cjk) in range(12, 21)
    assert len(cjk) // 4 == 3


def test_split_threshold_sees_code_and_cjk_as_longer_than_prose_of_the_same_length():
    prose = ("the plan is simple and clear " * 40)[:1000]
    code = ("if (x[i] != y[j]) { z += f(a, b); }\n" * 40)[:1000]
    cjk = "长文本" * 333
    p = estimate_prompt_tokens("/v1/completions", {"prompt": prose})
    assert estimate_prompt_tokens("/v1/completions", {"prompt": code}) > 1.5 * p
    assert estimate_prompt_tokens("/v1/completions", {"prompt": cjk}) > 3 * p
