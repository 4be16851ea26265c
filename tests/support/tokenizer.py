"""A tiny byte-level BPE tokenizer with a chat template, built in well under a second.

Shared by the LLM unit tests (tokenizer, detokenizer, preprocessing). The training text
mixes ASCII, accented Latin, CJK and emoji so multi-byte characters are split across
tokens in some places and merged in others.
"""

from __future__ import annotations

from pathlib import Path

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "<|{{ m['role'] }}|>{{ m['content'] }}<|end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

TEXT = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "Café crème brûlée, déjà vu, naïve résumé.",
    "日本語のテキスト。日本 東京 大阪",
    "Emoji: 🙂 🚀 👍🏽 and more 🙂🙂",
    "stop STOP stopping unstoppable ### END ###",
    "Numbers 0123456789 and symbols !@#$%^&*()",
] * 4

SPECIAL = ["<s>", "</s>", "<|end|>", "<|user|>", "<|assistant|>", "<|system|>"]


def build_tiny_tokenizer(out_dir: Path, *, with_chat_template: bool = True) -> Path:
    """Train the tokenizer and save it (HF format) into ``out_dir``; return ``out_dir``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TEXT, trainer=trainer)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        chat_template=CHAT_TEMPLATE if with_chat_template else None,
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    hf.save_pretrained(str(out_dir))
    return out_dir
