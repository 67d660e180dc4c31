"""A tiny Hugging Face Llama saved with a byte-level BPE tokenizer and a chat template (built offline), for
the server and chat tests."""

from __future__ import annotations

import torch

CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
SPECIALS = ["<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]
CORPUS = ["The quick brown fox jumps over the lazy dog.", "Hello world, hello server!",
          "Streaming tokens one at a time.", "A prompt, a completion, and a stop string."] * 4


def build_tokenizer(chat_template: str | None = CHAT_TEMPLATE):
    """Byte-level BPE (so characters outside the corpus split into several byte tokens)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   clean_up_tokenization_spaces=False)
    if chat_template is not None:
        fast.chat_template = chat_template
    return fast


def save_tiny_hf_llama(path, chat_template: str | None = CHAT_TEMPLATE, seed: int = 0):
    """Write a 2-layer random Llama and its tokenizer to ``path``; returns the tokenizer."""
    import transformers

    tokenizer = build_tokenizer(chat_template)
    cfg = transformers.LlamaConfig(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=512, bos_token_id=tokenizer.bos_token_id,
                                   eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g) if "norm" in name
                    else torch.randn(p.shape, generator=g) / (1 if "embed" in name else p.shape[-1] ** 0.5))
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return tokenizer
