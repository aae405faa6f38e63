"""A tiny offline model pair for smoke tests of the CLI and the benchmark: no downloads, seconds to build.

The tokenizer is character-level (one token per printable ASCII character or newline), built in memory with
`tokenizers`, so prompts, chat templates and streaming work exactly as with a real pair. The models are
random 2-layer Llamas in float64 (so that verifying k tokens in one forward and decoding them one by one pick
the same argmax: greedy outputs of every method are token-identical). The draft is the target with a little
weight noise, which gives a realistic, partial agreement.
"""

from __future__ import annotations

import string

import torch

SPECIALS = ("<pad>", "</s>", "<s>", "<unk>")
PAD, EOS, BOS, UNK = range(len(SPECIALS))
CHARS = "\n" + "".join(c for c in string.printable if c.isprintable())  # newline + the 95 printable ASCII
CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant> {% endif %}"
)


def tiny_tokenizer():
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for c in CHARS:
        vocab.setdefault(c, len(vocab))
    # BPE without merges and without a pre-tokenizer splits any text into single characters.
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    core.decoder = decoders.Fuse()  # characters join back without separators
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def tiny_model(vocab_size: int, seed: int = 0, layers: int = 2, hidden: int = 64):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        bos_token_id=BOS,
        eos_token_id=EOS,
        pad_token_id=PAD,
        initializer_range=0.2,  # peaked logits: greedy paths are well separated
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).double().eval()
    model.generation_config.pad_token_id = PAD
    model.generation_config.eos_token_id = EOS
    return model


def tiny_pair(seed: int = 0, noise: float = 0.01, device: str | torch.device = "cpu"):
    """(target, draft, tokenizer): the draft is the target with Gaussian weight noise of scale `noise`."""
    tokenizer = tiny_tokenizer()
    target = tiny_model(len(tokenizer), seed)
    draft = tiny_model(len(tokenizer), seed)
    draft.load_state_dict(target.state_dict())
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * noise)
    target.config._name_or_path, draft.config._name_or_path = "tiny-random-llama", "tiny-random-llama+noise"
    return target.to(device), draft.to(device), tokenizer
