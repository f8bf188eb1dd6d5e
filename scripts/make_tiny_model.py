"""Generate the tiny random-weight Llama model the real-vLLM tests serve.

No model can be downloaded on the test machines, so we build one: a byte-level BPE tokenizer
trained on a fixed in-script corpus (deterministic), a chat template, and a LlamaForCausalLM with
seeded random weights. 512 hidden / 4 layers / 8 heads (head_dim 64, which vLLM's CPU attention
requires) is the size at which a prefix-cache hit is ~10x faster than a cold prefill on one core.
Runs inside the vLLM venv (it needs torch, transformers, tokenizers).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def corpus() -> list[str]:
    words = (
        "the of and to in is you that it he was for on are as with his they at be this have from or one "
        "had by word but not what all were we when your can said there use an each which she do how their "
        "if will up other about out many then them these so some her would make like him into time has look "
        "two more write go see number no way could people my than first water been call who oil its now find "
        "long down day did get come made may part system prompt user assistant request model token cache "
        "prefix decode prefill router worker engine latency throughput hello world question answer"
    ).split()
    lines = []
    for i in range(4000):
        lines.append(" ".join(words[(i * 7 + j * 13) % len(words)] for j in range(12)) + f" {i}.")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--ffn", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=1024)
    args = ap.parse_args()

    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    specials = ["<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=args.vocab,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="</s>"
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=len(fast),
        hidden_size=args.hidden,
        intermediate_size=args.ffn,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=4096,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        torch_dtype="bfloat16",
    )
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(out)
    # vLLM reads the generation config; keep it free of sampling defaults.
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id})
    )
    print(f"wrote {out} ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params)")


if __name__ == "__main__":
    main()
