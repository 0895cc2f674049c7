"""Tokenizers: the built-in character-level tokenizer of the "tiny" preset, and prompt encoding.

Owned here: the char vocabulary that covers every built-in task (count, letter, arithmetic, sokoban),
``build_char_tokenizer()`` (made offline, nothing downloaded) and ``encode_prompts()``, the one function that
turns task prompts into token ids, and ``decode_completion()``, the one that turns completions into the text
a task scores: the inference peer and the trainer tokenize and decode the same way.
Called by ``echo_p2p.ml.models`` (tiny preset) and by the peers.
Must not load models or touch the network. Imports ``tokenizers``/``transformers`` inside functions only.
"""

from __future__ import annotations

import string
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from transformers import PreTrainedTokenizerBase

PAD_TOKEN = "<pad>"
EOS_TOKEN = "<eos>"
UNK_TOKEN = "<unk>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD_TOKEN, EOS_TOKEN, UNK_TOKEN)

#: Every character of the char tokenizer, in id order after the specials (pad=0, eos=1, unk=2).
#: Letters and digits (count, letter, arithmetic), operators, space and newline, the sokoban board symbols
#: (``# _ . $ * @ +``) and its moves (``U D L R``), and ``, :`` for short instructions.
CHAR_VOCAB: tuple[str, ...] = tuple(
    string.ascii_lowercase + string.digits + "=+-*>?" + " \n" + "#_.$@" + "UDLR" + ",:"
)


def char_vocab() -> dict[str, int]:
    """The char tokenizer's vocabulary: token -> id (specials first)."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in CHAR_VOCAB:
        if ch in vocab:
            raise AssertionError(f"duplicate char {ch!r} in CHAR_VOCAB")
        vocab[ch] = len(vocab)
    return vocab


def build_char_tokenizer() -> PreTrainedTokenizerBase:
    """A character-level ``PreTrainedTokenizerFast``: one token per character, unknown characters map to
    ``<unk>``, left padding (for batched generation), ``<eos>`` ends completions. Deterministic: the same
    ids on every peer. It saves and loads with ``save_pretrained`` / ``AutoTokenizer.from_pretrained``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel(char_vocab(), unk_token=UNK_TOKEN))
    core.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=PAD_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=UNK_TOKEN,
        padding_side="left",
        model_max_length=4096,
    )


def prepare_tokenizer(tokenizer: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    """Make any loaded tokenizer usable for batched sampling: left padding and a pad token (falls back to
    EOS when the tokenizer has none). Returns the same object."""
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token_id is None:
            raise ValueError(
                "tokenizer has neither a pad nor an EOS token: cannot mark where completions end"
            )
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def encode_prompts(
    tokenizer: PreTrainedTokenizerBase, prompts: list[str], use_chat_template: bool | None = None
) -> list[list[int]]:
    """Token ids of each prompt, unpadded. This is the single place where prompt text becomes ids: the
    inference peer and the trainer both call it.

    ``use_chat_template``: ``True`` wraps each prompt as one user message and appends the generation
    prompt (instruct models such as SmolLM2); ``False`` encodes the raw text; ``None`` (default) uses the
    chat template when the tokenizer has one. No special tokens are added in raw mode (no BOS/EOS).
    """
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if use_chat_template is None:
        use_chat_template = has_template
    if use_chat_template and not has_template:
        raise ValueError("use_chat_template=True but the tokenizer has no chat template")
    out: list[list[int]] = []
    for text in prompts:
        if use_chat_template:
            ids = tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
            )
            if isinstance(ids, dict) or hasattr(ids, "keys"):  # some versions return a BatchEncoding
                ids = ids["input_ids"]
            out.append([int(i) for i in ids])
        else:
            out.append([int(i) for i in tokenizer(text, add_special_tokens=False)["input_ids"]])
    return out


def decode_completion(tokenizer: PreTrainedTokenizerBase, token_ids: list[int]) -> str:
    """The text a task scores: the completion's tokens without the special tokens around it (EOS and
    padding at the end, padding or BOS at the start), decoded. A special token inside the completion stays in the text (``<unk>`` between the digits of a right
    answer makes it wrong, instead of vanishing from it). The inference peer (claimed reward) and the
    trainer (re-score) must both use this."""
    special = set(tokenizer.all_special_ids)
    start, end = 0, len(token_ids)
    while end > start and token_ids[end - 1] in special:
        end -= 1
    while start < end and token_ids[start] in special:
        start += 1
    return tokenizer.decode(list(token_ids[start:end]), skip_special_tokens=False)
