"""Training conversations -> (ids, assistant-token mask): chat template and the plain fallback."""

from __future__ import annotations

import pytest

from peagle_jax.conversations.chat import ConversationError, encode_prompt, encode_training

TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }} : {{ m['content'] }} </s>{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant :{% endif %}"
)
WORDS = ["hello", "there", "how", "are", "you", "fine", "thanks", "bye", "sure", "ok"]


def _tokenizer(template: str | None):
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {
        t: i
        for i, t in enumerate(
            [
                "<pad>",
                "</s>",
                "<bos>",
                "<unk>",
                "<s>",
                "user",
                "assistant",
                "system",
                "User",
                "Assistant",
                "System",
                ":",
            ]
            + WORDS
        )
    }
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 2)])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<bos>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )
    if template:
        fast.chat_template = template
    return fast


CONV = [
    {"role": "user", "content": "hello there"},
    {"role": "assistant", "content": "fine thanks"},
    {"role": "user", "content": "how are you"},
    {"role": "assistant", "content": "sure ok bye"},
]


def _supervised(tok, ids, mask):
    return tok.convert_ids_to_tokens([i for i, m in zip(ids, mask) if m])


def test_chat_template_masks_assistant_tokens_only():
    tok = _tokenizer(TEMPLATE)
    ids, mask = encode_training(tok, CONV)
    assert len(ids) == len(mask)
    # the assistant header (what the generation prompt adds) is not supervised; content and end are
    assert _supervised(tok, ids, mask) == ["fine", "thanks", "</s>", "sure", "ok", "bye", "</s>"]
    # a prompt in the same format is a prefix of the training ids
    prompt = encode_prompt(tok, CONV[:1])
    assert ids[: len(prompt)] == prompt


def test_plain_fallback_masks_assistant_tokens_only():
    tok = _tokenizer(None)
    ids, mask = encode_training(tok, CONV)
    toks = tok.convert_ids_to_tokens(ids)
    assert toks[0] == "<bos>"
    assert _supervised(tok, ids, mask) == ["fine", "thanks", "</s>", "sure", "ok", "bye", "</s>"]
    assert "Assistant" in toks
    assert not any(m for t, m in zip(toks, mask) if t in ("User", "Assistant", ":"))
    prompt = encode_prompt(tok, CONV[:1])
    assert ids[: len(prompt)] == prompt
    assert tok.convert_ids_to_tokens(prompt)[-2:] == ["Assistant", ":"]


def test_plain_forced_on_a_templated_tokenizer():
    tok = _tokenizer(TEMPLATE)
    ids, _ = encode_training(tok, CONV, template="plain")
    assert "Assistant" in tok.convert_ids_to_tokens(ids)


@pytest.mark.parametrize(
    "conv, msg",
    [
        ([{"role": "user", "content": "hello"}], "no assistant turn"),
        ([], "non-empty"),
        ([{"role": "user"}], "message 0"),
    ],
)
def test_bad_conversations_are_refused(conv, msg):
    with pytest.raises(ConversationError, match=msg):
        encode_training(_tokenizer(None), conv)


def test_chat_template_required_when_asked():
    with pytest.raises(ConversationError, match="no chat template"):
        encode_training(_tokenizer(None), CONV, template="chat")
