"""SSD on two tiny models built from configs, where the draft is the target with noise added to its weights.

    python examples/tiny_noisy_pair.py --noise 0.001 --max-new-tokens 64

Prints whether greedy SSD equals the target alone and the SSD statistics (hit rate, acceptance, bubble ratio).
"""

from __future__ import annotations

import argparse

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import hf_ssd


def tiny_pair(noise: float, seed: int = 0):
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         initializer_range=0.2)
    target = LlamaForCausalLM(config).eval()
    draft = LlamaForCausalLM(config).eval()
    draft.load_state_dict(target.state_dict())
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn_like(p) * noise)
    return target, draft


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--noise", type=float, default=0.001)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--layout", default="auto")
    args = parser.parse_args()
    torch.set_num_threads(1)
    target, draft = tiny_pair(args.noise)
    hf_ssd.enable(target)
    ids = torch.randint(3, 256, (1, 16), generator=torch.Generator().manual_seed(1))
    gen = dict(max_new_tokens=args.max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    ref = target.generate(ids, **gen)
    out = target.generate(ids, assistant_model=draft, ssd_config=hf_ssd.SSDConfig(gamma=args.gamma, layout=args.layout,
                                                                                  hit_rate_warning=0), **gen)
    stats = hf_ssd.last_stats(target)
    print(f"greedy identical to target alone: {out.tolist() == ref.tolist()}")
    print(f"hit rate {stats.hit_rate:.1%} ({stats.cache_hits}/{stats.lookups}), acceptance {stats.acceptance_rate:.1%}, "
          f"bubble ratio {stats.bubble_ratio:.1%}, rounds {stats.rounds}, layout {stats.layout}")


if __name__ == "__main__":
    main()
