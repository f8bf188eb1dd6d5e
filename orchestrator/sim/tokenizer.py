"""The simulated engines' tokenizer (one token per word): defined in ``orchestrator.kv.word_tokenizer``
because the gateway tokenizes for simulated engines with it and production code never imports the
simulator; re-exported here for the simulator's own modules."""

from orchestrator.kv.word_tokenizer import DEFAULT_VOCAB_SIZE, SimTokenizer, output_token_ids

__all__ = ["DEFAULT_VOCAB_SIZE", "SimTokenizer", "output_token_ids"]
