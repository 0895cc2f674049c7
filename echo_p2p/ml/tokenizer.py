"""Tokenizers: the built-in character-level tokenizer of the "tiny" preset, and prompt encoding.

Owned here: the char vocabulary that covers every built-in task (count, letter, arithmetic, sokoban),
``build_char_tokenizer()`` (made offline, nothing downloaded) and ``encode_prompts()``, the one function that
turns task prompts into token ids, and ``decode_completion()``, the one that turns completions into the text
a task scores: the inference peer and the trainer tokenize and decode the same way. A prompt is a text or a
conversation (TRL's conversational format: a list of ``{"role", "content"}`` messages), which
``check_conversation`` bounds and ``encode_prompts`` renders with the model's chat template;
``check_chat_template`` refuses, when a peer starts, a conversational task on a tokenizer without one.
Called by ``echo_p2p.ml.models`` (tiny preset) and by the peers.
Must not load models or touch the network. Imports ``tokenizers``/``transformers`` inside functions only.
"""

from __future__ import annotations

import string
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

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


#: The roles of a conversational prompt's messages (TRL's conversational format; no tool messages).
CHAT_ROLES: tuple[str, ...] = ("system", "user", "assistant")
#: Most messages in one conversational prompt.
MAX_CONVERSATION_MESSAGES = 64
#: Most characters of content in one conversational prompt, all messages together (tokens are bounded
#: later, by the trainer's ``max_prompt_tokens`` at ingest).
MAX_CONVERSATION_CHARS = 65_536

#: A prompt: a text, or a conversation (a list of ``{"role": ..., "content": ...}`` messages).
Prompt = str | list[dict[str, str]]


def check_conversation(messages: Any) -> list[dict[str, str]]:
    """``messages`` as a conversational prompt (a new list of ``{"role", "content"}`` dicts), or
    ``ValueError`` naming what is wrong: not a non-empty list, a message that is not an object with exactly a
    ``role`` and a ``content``, a role outside ``CHAT_ROLES``, a content that is not a string, more than
    ``MAX_CONVERSATION_MESSAGES`` messages or ``MAX_CONVERSATION_CHARS`` characters, or a last message that
    is not the user's (the model answers it; continuing an assistant message is not supported)."""
    if not isinstance(messages, list | tuple):
        raise ValueError(f"a conversation is a list of messages, not a {type(messages).__name__}")
    if not messages:
        raise ValueError("the conversation has no message")
    if len(messages) > MAX_CONVERSATION_MESSAGES:
        raise ValueError(
            f"the conversation has {len(messages)} messages, more than {MAX_CONVERSATION_MESSAGES}"
        )
    out: list[dict[str, str]] = []
    chars = 0
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or set(message) != {"role", "content"}:
            keys = sorted(message) if isinstance(message, dict) else type(message).__name__
            raise ValueError(f"message {i} must be an object with exactly 'role' and 'content' (got {keys})")
        role, content = message["role"], message["content"]
        if role not in CHAT_ROLES:
            raise ValueError(
                f"message {i} has role {str(role)[:32]!r}: the roles are {', '.join(CHAT_ROLES)}"
            )
        if not isinstance(content, str):
            raise ValueError(
                f"message {i}'s content is a {type(content).__name__}, not a string (prompts are text only)"
            )
        chars += len(content)
        out.append({"role": role, "content": content})
    if chars > MAX_CONVERSATION_CHARS:
        raise ValueError(
            f"the conversation has {chars} characters of content, more than {MAX_CONVERSATION_CHARS}"
        )
    if out[-1]["role"] != "user":
        raise ValueError(
            f"the last message is the {out[-1]['role']}'s: a conversational prompt ends with a user message "
            "(continuing an assistant message is not supported)"
        )
    return out


def has_chat_template(tokenizer: PreTrainedTokenizerBase) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def check_chat_template(
    tokenizer: PreTrainedTokenizerBase, conversational: bool, use_chat_template: bool | None = None
) -> None:
    """``ValueError`` with the reason when prompts of a task (``conversational``: made of messages) cannot be
    encoded with this tokenizer and setting: a conversation needs the model's chat template. Peers call it
    when they start, before sampling or accepting anything."""
    if not conversational:
        return
    if not has_chat_template(tokenizer):
        raise ValueError(
            "the task's prompts are conversations (lists of {role, content} messages), which are rendered "
            "with the model's chat template, and this model's tokenizer has none: use a chat model (e.g. "
            "--model smollm2) or text prompts"
        )
    if use_chat_template is False:
        raise ValueError(
            "the task's prompts are conversations, which are rendered with the model's chat template, and "
            "use_chat_template is false: leave it unset"
        )


def encode_prompts(
    tokenizer: PreTrainedTokenizerBase, prompts: Sequence[Prompt], use_chat_template: bool | None = None
) -> list[list[int]]:
    """Token ids of each prompt, unpadded. This is the single place where prompts become ids: the inference
    peer and the trainer both call it.

    A text prompt: ``use_chat_template`` ``True`` wraps it as one user message and appends the generation
    prompt (instruct models such as SmolLM2); ``False`` encodes the raw text; ``None`` (default) uses the
    chat template when the tokenizer has one. No special tokens are added in raw mode (no BOS/EOS).
    A conversation (a list of messages, ``check_conversation``) is always rendered with the chat template
    and the generation prompt (``ValueError`` without a template or with ``use_chat_template=False``).
    """
    has_template = has_chat_template(tokenizer)
    if use_chat_template is None:
        use_chat_template = has_template
    out: list[list[int]] = []
    for prompt in prompts:
        if isinstance(prompt, str):
            if use_chat_template and not has_template:
                raise ValueError("use_chat_template=True but the tokenizer has no chat template")
            if use_chat_template:
                out.append(_render_chat(tokenizer, [{"role": "user", "content": prompt}]))
            else:
                out.append([int(i) for i in tokenizer(prompt, add_special_tokens=False)["input_ids"]])
        else:
            check_chat_template(tokenizer, True, use_chat_template)
            out.append(_render_chat(tokenizer, check_conversation(prompt)))
    return out


def _render_chat(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]]) -> list[int]:
    """``messages`` through the tokenizer's chat template, with the generation prompt, as token ids."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):  # some versions return a BatchEncoding
        ids = ids["input_ids"]
    return [int(i) for i in ids]


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
