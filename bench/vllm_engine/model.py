"""Make the harness's model: a tiny random-weight Llama and a trained byte-level BPE tokenizer.

    <cache>/venv/bin/python bench/vllm_engine/model.py OUT_DIR [--corpus FILE ...]

Runs with the vLLM venv's Python (it needs torch, transformers and tokenizers, which are
not kvstream's dependencies). The tokenizer is trained here on ``--corpus`` (default:
this repository's ``docs/*.md`` and ``README.md``, so the vocabulary is deterministic and
nothing is downloaded): byte-level BPE, 4,000 tokens, a BOS added by the post-processor
as Llama 3's does, and a ChatML chat template in ``tokenizer_config.json``. The model is
2 layers of hidden size 128 with 2 heads of 64 (vLLM's CPU attention refuses head_dim
16), float32, seeded; its answers are noise, which is all a KV cache test needs.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

BOS, EOS, IM_START, IM_END = "<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>"
VOCAB = 4000
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def make_tokenizer(out: Path, corpus: list[Path]) -> int:
    """Train and save the tokenizer into ``out``; returns its vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=[BOS, EOS, IM_START, IM_END],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train([str(p) for p in corpus], trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=EOS,
                                   additional_special_tokens=[IM_START, IM_END])
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out))
    # Older readers look for the template in tokenizer_config.json itself; write it there too.
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    if "chat_template" not in cfg:
        cfg["chat_template"] = CHAT_TEMPLATE
        cfg_path.write_text(json.dumps(cfg, indent=2))
    return int(tok.get_vocab_size())


def make_model(out: Path, vocab: int, bos_id: int, eos_id: int) -> None:
    """Save a seeded random-weight 2-layer Llama into ``out``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096,
                      bos_token_id=bos_id, eos_token_id=eos_id, tie_word_embeddings=True, torch_dtype="float32")
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(str(out), safe_serialization=True)


def main() -> None:
    repo = Path(__file__).resolve().parents[2]
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--corpus", type=Path, nargs="+",
                    default=sorted((repo / "docs").glob("*.md")) + [repo / "README.md"])
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    vocab = make_tokenizer(args.out, args.corpus)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(args.out / "tokenizer.json"))
    make_model(args.out, vocab, tok.token_to_id(BOS), tok.token_to_id(EOS))
    (args.out / "kvstream-bench.json").write_text(json.dumps({"vocab": vocab, "made_by": "bench/vllm_engine/model.py"}))
    print(f"model and tokenizer in {args.out} (vocab {vocab})")


if __name__ == "__main__":
    main()
