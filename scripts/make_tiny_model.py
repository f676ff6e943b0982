"""Build a tiny Llama model and tokenizer locally, for real vLLM on a CPU (no model hub here).

Runs in the vLLM venv (it needs torch, transformers and tokenizers):

    .venv-vllm/bin/python scripts/make_tiny_model.py build/tiny-model

- Tokenizer: byte-level BPE with 1024 tokens, trained on the Python standard library's own
  sources (always on the machine), with a chat template so /v1/chat/completions works.
- Model: random LlamaForCausalLM, hidden 128, 2 layers, 4 heads of dim 32 (vLLM's CPU attention
  needs a head size of 32, 64, 80, ...), seeded, so two builds are identical.
- initializer_range 0.5: with the default 0.02 the output barely depends on the prompt, and an
  output comparison would not notice a proxy that mixed prompts up.
"""

from __future__ import annotations

import argparse
import sys
import sysconfig
from pathlib import Path

VOCAB_SIZE = 1024
HIDDEN = 128
LAYERS = 2
HEADS = 4
MAX_POSITIONS = 2048
INITIALIZER_RANGE = 0.5
SEED = 1234
TRAINING_FILES = 200
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def training_files() -> list[str]:
    """Some of the standard library's sources, in a stable order."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return [str(p) for p in sorted(stdlib.glob("*.py"))[:TRAINING_FILES]]


def build_tokenizer(out: Path) -> None:
    """Train and save the tokenizer (with the chat template)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=["<s>", "</s>", "<unk>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train(training_files(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)


def build_model(out: Path) -> None:
    """Save a seeded random Llama."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    config = LlamaConfig(vocab_size=VOCAB_SIZE, hidden_size=HIDDEN, intermediate_size=4 * HIDDEN,
                         num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                         num_key_value_heads=HEADS, head_dim=HIDDEN // HEADS,
                         max_position_embeddings=MAX_POSITIONS,
                         initializer_range=INITIALIZER_RANGE, bos_token_id=0, eos_token_id=1,
                         tie_word_embeddings=False, torch_dtype="float32")
    LlamaForCausalLM(config).save_pretrained(out)


def main(argv: list[str] | None = None) -> int:
    """Entry point."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path)
    ns = parser.parse_args(argv)
    ns.out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(ns.out)
    build_model(ns.out)
    (ns.out / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    print(f"tiny model written to {ns.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
