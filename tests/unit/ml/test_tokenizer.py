from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from echo_p2p.ml.tokenizer import (
    CHAR_VOCAB,
    MAX_CONVERSATION_CHARS,
    MAX_CONVERSATION_MESSAGES,
    build_char_tokenizer,
    char_vocab,
    check_chat_template,
    check_conversation,
    decode_completion,
    encode_prompts,
)
from echo_p2p.tasks.registry import BUILTIN_TASKS, build_task


def test_char_vocab_is_small_and_has_specials_first():
    vocab = char_vocab()
    assert len(vocab) < 80
    assert [vocab["<pad>"], vocab["<eos>"], vocab["<unk>"]] == [0, 1, 2]
    assert len(set(CHAR_VOCAB)) == len(CHAR_VOCAB)


@pytest.mark.parametrize("name", BUILTIN_TASKS)
def test_every_builtin_prompt_and_answer_is_in_the_vocabulary(name):
    task = build_task(name)
    allowed = set(CHAR_VOCAB)
    ids = range(task.num_prompts) if task.num_prompts else range(20)
    for i in ids:
        assert set(task.prompt(i)) <= allowed, (name, task.prompt(i))
    assert set("0123456789-UDLR") <= allowed


def test_encode_decode_round_trip_and_unknown_chars():
    tok = build_char_tokenizer()
    text = "12+34=\n#_.$@*+ UDLR, ok: 5>?"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text)
    assert tok.decode(ids) == text
    assert tok("Z", add_special_tokens=False)["input_ids"] == [tok.unk_token_id]
    assert tok.decode(ids + [tok.eos_token_id], skip_special_tokens=True) == text


def test_left_padding():
    tok = build_char_tokenizer()
    batch = tok(["a", "abc"], padding=True)
    assert batch["input_ids"][0][:2] == [tok.pad_token_id] * 2
    assert batch["attention_mask"][0] == [0, 0, 1]


def test_save_and_load_with_auto_tokenizer(tmp_path):
    tok = build_char_tokenizer()
    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    text = "3b=bbb"
    assert loaded(text)["input_ids"] == tok(text)["input_ids"]
    assert (loaded.pad_token_id, loaded.eos_token_id, loaded.padding_side) == (0, 1, "left")


def test_encode_prompts_raw_and_chat_template_error():
    tok = build_char_tokenizer()
    ids = encode_prompts(tok, ["3a=", "c>"])
    assert [tok.decode(i) for i in ids] == ["3a=", "c>"]
    assert ids == encode_prompts(tok, ["3a=", "c>"], use_chat_template=False)
    with pytest.raises(ValueError, match="no chat template"):
        encode_prompts(tok, ["x"], use_chat_template=True)


def test_decode_completion_drops_eos_and_padding():
    tok = build_char_tokenizer()
    ids = tok("ccc", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert decode_completion(tok, ids) == "ccc"
    assert decode_completion(tok, [tok.pad_token_id, *ids]) == "ccc"


def test_decode_completion_keeps_a_special_token_inside_the_text():
    """An ``<unk>`` between the characters of a right answer must not vanish from what the task scores
    (a stranger's trick to get reward 1.0 for a malformed completion)."""
    tok = build_char_tokenizer()
    inner = next(i for i in tok.all_special_ids if i not in (tok.eos_token_id, tok.pad_token_id))
    c = tok("c", add_special_tokens=False)["input_ids"]
    text = decode_completion(tok, [*c, inner, *c, tok.eos_token_id])
    assert text != "cc" and text.startswith("c") and text.endswith("c") and len(text) > 2


#: A chat template over the char tokenizer's own characters: "u:text\n" per message, "a:" to answer.
CHAR_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}a:{% endif %}"
)


def chat_char_tokenizer():
    tok = build_char_tokenizer()
    tok.chat_template = CHAR_CHAT_TEMPLATE
    return tok


def test_a_conversation_is_rendered_with_the_chat_template_and_the_generation_prompt():
    tok = chat_char_tokenizer()
    conversation = [
        {"role": "system", "content": "be short"},
        {"role": "user", "content": "2+2="},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "3+5="},
    ]
    (ids,) = encode_prompts(tok, [conversation])
    assert tok.decode(ids) == "s:be short\nu:2+2=\na:4\nu:3+5=\na:"
    # the same ids whatever use_chat_template says for text prompts (None or True), and a text prompt is
    # rendered as one user message with the same template
    assert encode_prompts(tok, [conversation], use_chat_template=True) == [ids]
    assert encode_prompts(tok, ["3+5="]) == encode_prompts(tok, [[{"role": "user", "content": "3+5="}]])
    assert tok.decode(encode_prompts(tok, ["3+5="], use_chat_template=False)[0]) == "3+5="


def test_a_conversation_without_a_chat_template_is_refused_with_the_reason():
    conversation = [{"role": "user", "content": "3+5="}]
    with pytest.raises(ValueError, match="tokenizer has none"):
        encode_prompts(build_char_tokenizer(), [conversation])
    with pytest.raises(ValueError, match="tokenizer has none"):
        check_chat_template(build_char_tokenizer(), conversational=True)
    with pytest.raises(ValueError, match="use_chat_template is false"):
        encode_prompts(chat_char_tokenizer(), [conversation], use_chat_template=False)
    check_chat_template(build_char_tokenizer(), conversational=False)  # text prompts need no template
    check_chat_template(chat_char_tokenizer(), conversational=True)


@pytest.mark.parametrize(
    ("conversation", "reason"),
    [
        ("3+5=", "a list of messages, not a str"),
        ([], "no message"),
        ([{"role": "tool", "content": "x"}], "role 'tool'"),
        ([{"role": "user", "content": 42}], "content is a int, not a string"),
        ([{"role": "user", "content": [{"type": "text", "text": "x"}]}], "content is a list, not a string"),
        ([{"role": "user"}], "exactly 'role' and 'content'"),
        ([{"role": "user", "content": "x", "name": "bob"}], "exactly 'role' and 'content'"),
        (["user: x"], "exactly 'role' and 'content'"),
        (
            [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}],
            "ends with a user message",
        ),
        ([{"role": "user", "content": "x"}] * (MAX_CONVERSATION_MESSAGES + 1), "more than 64"),
        ([{"role": "user", "content": "x" * (MAX_CONVERSATION_CHARS + 1)}], "characters of content, more"),
    ],
)
def test_malformed_conversations_are_refused_with_the_reason(conversation, reason):
    with pytest.raises(ValueError, match=reason):
        check_conversation(conversation)
    if not isinstance(conversation, str):  # (a string given to encode_prompts is a text prompt)
        with pytest.raises(ValueError, match=reason):
            encode_prompts(chat_char_tokenizer(), [conversation])
