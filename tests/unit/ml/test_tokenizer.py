from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from echo_p2p.ml.tokenizer import (
    CHAR_VOCAB,
    build_char_tokenizer,
    char_vocab,
    decode_completion,
    encode_prompts,
)
from echo_p2p.tasks import BUILTIN_TASKS, build_task


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
