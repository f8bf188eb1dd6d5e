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
