"""Makes a tiny Llama for vLLM to serve, with random weights and a tokenizer trained
here (no model hub is needed): the vLLM connector's tests and benchmark serve it.

    python tests/vllm_model.py OUT_DIR [--layers 2] [--hidden 256] [--heads 4] [--kv-heads 4] [--head-dim N]

Runs in the vLLM virtualenv (scripts/vllm-env.sh), which has torch, transformers and
tokenizers. The same arguments and seed make the same model.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

# Text to train the tokenizer on: enough words for a few hundred merges.
CORPUS = """
The prefill instance computes the prompt and the decode instance generates the answer.
Every layer keeps keys and values for each token in blocks of memory, and those blocks
move from one instance to the other when a request changes hands. A transfer engine
moves bytes between processes, hosts and devices; it registers memory once and then
reads or writes it on request. Caches hold what was computed so that it need not be
computed again. Numbers one two three four five six seven eight nine ten hundred.
""" * 4


def make(out: Path, layers: int, hidden: int, heads: int, kv_heads: int, intermediate: int, vocab: int,
         seed: int, context: int, head_dim: int = 0) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS.split("\n"), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.model_max_length = context
    fast.save_pretrained(out)

    torch.manual_seed(seed)
    # A head wider than hidden / heads gives a model whose KV is large next to its
    # compute (the benchmark's), as in models with few, wide KV heads.
    head_dim = head_dim or hidden // heads
    config = LlamaConfig(head_dim=head_dim,
        vocab_size=tok.get_vocab_size(), hidden_size=hidden, intermediate_size=intermediate,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=context, bos_token_id=1, eos_token_id=2,
        # With the usual 0.02, greedy decoding of random weights repeats one token;
        # larger weights give outputs that differ from prompt to prompt.
        initializer_range=0.1, tie_word_embeddings=False, torch_dtype="bfloat16",
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    (out / "freight-model.json").write_text(json.dumps({
        "layers": layers, "hidden": hidden, "heads": heads, "kv_heads": kv_heads, "seed": seed,
        "head_dim": head_dim, "kv_bytes_per_token": 2 * layers * kv_heads * head_dim * 2,
    }) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=0, help="default: hidden / heads")
    ap.add_argument("--intermediate", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=1000)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    make(a.out, a.layers, a.hidden, a.heads, a.kv_heads, a.intermediate, a.vocab, a.seed, a.context, a.head_dim)


if __name__ == "__main__":
    main()
