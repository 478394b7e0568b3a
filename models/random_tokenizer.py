"""The tokenizer and chat templates that random checkpoints carry (`random_checkpoint.py`): a
byte-level BPE trained on a small inline corpus, and each family's chat template with the special
tokens it writes, so tokenizer and chat tests need no downloads."""
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import tokenizers


BOS_TOKEN, EOS_TOKEN, PAD_TOKEN = "<s>", "</s>", "<pad>"
# Listed first so they get ids 0, 1, 2 whatever the corpus contains.
SPECIAL_TOKENS: tuple[str, ...] = (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN)

CORPUS = """\
The kiln was built at the edge of the village, where the clay from the river bank
was dug every spring. Potters carried their bowls, jugs and tiles up the hill in
wooden carts, and the fire was kept burning for three days and two nights.
Nobody slept much; someone always had to feed the flames and watch the colour of
the smoke, which turned from black to grey to almost nothing when the heat was right.

A compiler is a patient machine. It reads a description of a program, checks that
every piece fits, and then rewrites the whole thing in a language that the
hardware understands. Good compilers do their work ahead of time, so that the
program itself can run quickly and predictably when it finally meets real data.

Language models predict the next token from the tokens they have already seen.
Each layer mixes information across positions with attention, then transforms
every position on its own with a small feed-forward network. The weights are just
numbers: billions of them, stored in files, loaded into memory, multiplied again
and again until a sentence appears, one word at a time.

On Tuesday, 14 March 2023, at 09:45, the train from Lyon arrived 17 minutes late.
Tickets cost 42.50 euros (or $45.99); seats 1-128 were reserved, 129-256 were not!
Is it 3.14159, 2.71828 or 1.41421? Call +1 (555) 010-2024, ext. 7; e-mail: hi@ex.org.
Prices rose by 12% in Q3 -- "unexpectedly", said the report; see section [4.2] & {notes}.

She ordered a café au lait and a croissant, and asked the naïve question everybody
wanted to ask: why is the crème brûlée always gone by noon? The waiter, a former
jalapeño farmer from Zürich, shrugged. In 日本 they drink green tea; 東京 is busy,
and the word for thank you is ありがとう. Good morning in Greek is Καλημέρα, in
Russian доброе утро, and the symbols €, £, ¥, °, ±, → and ✓ all need several bytes.

Quick brown foxes jump over lazy dogs; def f(x): return x * 2  # 0123456789
"""


def train_tokenizer(vocab_size: int = 384) -> "tokenizers.Tokenizer":
    """Train a deterministic byte-level BPE tokenizer on the inline corpus.

    The corpus is small: `vocab_size` is a ceiling, reached up to a few hundred.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=1, special_tokens=list(SPECIAL_TOKENS),
        # The full byte alphabet makes any UTF-8 input encodable, even bytes
        # that never occur in the corpus.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    # Paragraph-sized chunks; one per line would cut words at the line breaks.
    tokenizer.train_from_iterator(CORPUS.split("\n\n"), trainer=trainer)
    bos_id = tokenizer.token_to_id(BOS_TOKEN)
    # Prepend BOS like the Llama tokenizers do, so `add_special_tokens` behaves
    # the same as on a real checkpoint.
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
        special_tokens=[(BOS_TOKEN, bos_id)])
    return tokenizer


# Chat templates as real checkpoints of each family carry them (transformers keeps them in
# tokenizer_config.json), with the special tokens they use added to the tokenizer, so chat tests
# need no downloads. Families without a chat format of their own get a plain role-tagged one.
_ROLE_CHECK = ("{%- if message['role'] not in ['system', 'user', 'assistant'] %}"
               "{{- raise_exception('Conversation roles must be system, user or assistant, not ' + message['role']) }}"
               "{%- endif %}\n")
_LLAMA3_TEMPLATE = (
    "{{- bos_token }}\n"
    "{%- for message in messages %}\n" + _ROLE_CHECK +
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim"
    " + '<|eot_id|>' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n"
    "{%- endif %}\n")
_CHATML_TEMPLATE = (
    "{%- for message in messages %}\n"
    "{%- if loop.first and message['role'] != 'system' %}\n"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}\n"
    "{%- endif %}\n"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "{{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n")
_PLAIN_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}"
    "{{ eos_token }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
# family -> (template, the special tokens it writes)
_CHAT_FORMATS: dict[str, tuple[str, tuple[str, ...]]] = {
    "llama3": (_LLAMA3_TEMPLATE, ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")),
    "llama3.2": (_LLAMA3_TEMPLATE, ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")),
    "qwen2": (_CHATML_TEMPLATE, ("<|im_start|>", "<|im_end|>")),
    "qwen3": (_CHATML_TEMPLATE, ("<|im_start|>", "<|im_end|>")),
}


def _chat_format(family: str) -> tuple[str, tuple[str, ...]]:
    return _CHAT_FORMATS.get(family, (_PLAIN_TEMPLATE, ()))


def chat_template(family: str) -> str:
    """The chat template that make-checkpoint writes for `family`."""
    return _chat_format(family)[0]


def chat_tokens(family: str) -> tuple[str, ...]:
    """The special tokens `family`'s chat template writes (added to its tokenizer)."""
    return _chat_format(family)[1]


def save_tokenizer(tokenizer: "tokenizers.Tokenizer", directory: Path, max_length: int, family: str) -> None:
    tokenizer.save(str(directory / "tokenizer.json"))
    special = {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN}
    tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast", **special,
                        "model_max_length": max_length, "clean_up_tokenization_spaces": False,
                        "chat_template": chat_template(family)}
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    (directory / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
