"""Config files are checked field by field when they load (`peagle_jax.config.target_config`'s spec tables):
target config.json of every family (types, ranges, token ids in the vocabulary, the attention
shape), generation_config.json, drafter heads in the vLLM and speculators layouts, and corrupt
tokenizer files. Each error is one line naming the file and the key; through `python -m infer` it
is the one `error:` line, exit status 1."""

from __future__ import annotations

import json
import shutil

import hf_tiny
import pytest
from head_folders import V, hand_tensors, speculators_cfg, vllm_config, write_folder
from in_process import run_module

import peagle_jax as pj
from infer.__main__ import main
from peagle_jax.config.target_config import ConfigError
from peagle_jax.formats import read_speculators_config, read_vllm_config
from peagle_jax.handles.target import load_tokenizer
from peagle_jax.models.registry import target_config

# family -> the tiny HF model (tests/hf_tiny.py) whose config.json the tests edit
KINDS = {
    "llama": "llama-gqa2-tied-llama3",
    "qwen3": "qwen3",
    "gemma3": "gemma3",
    "qwen3_moe": "qwen3_moe",
    "gpt_oss": "gpt_oss",
}
DROP = object()  # an edit value: remove the key
VOCAB, LAYERS = hf_tiny.VOCAB, hf_tiny.LAYERS


@pytest.fixture(scope="module")
def raw_configs(tmp_path_factory):
    """family -> the config.json of its tiny HF model, as transformers saves it (no weights)."""
    out = {}
    for family, kind in KINDS.items():
        folder = tmp_path_factory.mktemp(kind)
        hf_tiny._hf_config(*hf_tiny.SPECS[kind]).save_pretrained(str(folder))
        out[family] = json.loads((folder / "config.json").read_text())
    return out


def _edited(cfg: dict, edit: dict) -> dict:
    cfg = json.loads(json.dumps(cfg))
    for key, value in edit.items():
        if value is DROP:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    return cfg


def _assert_names(err: Exception, where: str, *parts: str) -> str:
    msg = str(err)
    assert msg.startswith(where), msg
    assert "\n" not in msg, msg
    for part in parts:
        assert part in msg, msg
    return msg


# (edit, key named, text) for every family
COMMON = [
    ({"hidden_size": "1024"}, "hidden_size", "must be a positive int, got '1024' (str)"),
    ({"vocab_size": None}, "vocab_size", "must be a positive int, got null"),
    ({"hidden_size": DROP}, "hidden_size", "missing key 'hidden_size'"),
    ({"num_hidden_layers": 12.5}, "num_hidden_layers", "got 12.5 (float)"),
    ({"num_attention_heads": True}, "num_attention_heads", "got True (bool)"),
    ({"vocab_size": -5}, "vocab_size", "must be a positive int, got -5"),
    ({"intermediate_size": 0}, "intermediate_size", "must be a positive int"),
    ({"num_key_value_heads": 3}, "num_attention_heads", "4 must be a multiple of num_key_value_heads 3"),
    ({"num_key_value_heads": "2"}, "num_key_value_heads", "must be a positive int or null"),
    ({"head_dim": 15}, "head_dim", "15 must be even"),
    ({"head_dim": -16}, "head_dim", "must be a positive int or null"),
    ({"max_position_embeddings": "128"}, "max_position_embeddings", "must be a positive int"),
    ({"eos_token_id": "1"}, "eos_token_id", f"in [0, vocab_size {VOCAB}) or null, got '1' (str)"),
    ({"eos_token_id": [1, VOCAB]}, "eos_token_id", f"got [1, {VOCAB}] (list)"),
    ({"eos_token_id": [1, "2"]}, "eos_token_id", "a list of token ids"),
    ({"bos_token_id": -1}, "bos_token_id", f"a token id in [0, vocab_size {VOCAB})"),
    ({"pad_token_id": VOCAB}, "pad_token_id", f"got {VOCAB} (int)"),
    ({"rms_norm_eps": 0}, "rms_norm_eps", "must be a positive finite number"),
    ({"rms_norm_eps": "1e-6"}, "rms_norm_eps", "got '1e-6' (str)"),
    ({"rms_norm_eps": float("inf")}, "rms_norm_eps", "got inf (float)"),
    ({"rope_theta": -1.0}, "rope_theta", "must be a positive finite number"),
    ({"tie_word_embeddings": "false"}, "tie_word_embeddings", "must be true or false"),
    ({"attention_bias": 1}, "attention_bias", "must be true or false"),
    ({"hidden_act": "relu"}, "hidden_act", "must be one of 'silu'"),
]
FAMILY = {
    "llama": [
        ({"mlp_bias": "no"}, "mlp_bias", "must be true or false"),
        (
            {"rope_parameters": {**hf_tiny.SPECS[KINDS["llama"]][1]["rope_parameters"], "factor": "8"}},
            "key 'rope_parameters': factor",
            "must be a positive finite number or null",
        ),
        (
            {"rope_parameters": {**hf_tiny.SPECS[KINDS["llama"]][1]["rope_parameters"], "low_freq_factor": None}},
            "low_freq_factor",
            "got null",
        ),
    ],
    "qwen3": [
        ({"sliding_window": 0}, "sliding_window", "must be a positive int or null, got 0"),
        ({"use_sliding_window": "yes"}, "use_sliding_window", "must be true or false"),
        ({"max_window_layers": -1}, "max_window_layers", "must be a non-negative int"),
        ({"rope_scaling": [1]}, "rope_scaling", "must be an object or null"),
    ],
    "gemma3": [
        ({"sliding_window": 0}, "sliding_window", "must be a positive int or null"),
        ({"layer_types": ["chunked_attention"] * LAYERS}, "layer_types", "must be a list of 'full_attention'"),
        ({"query_pre_attn_scalar": "24"}, "query_pre_attn_scalar", "must be a positive finite number"),
        ({"final_logit_softcapping": -4.0}, "final_logit_softcapping", "positive finite number or null"),
        ({"_sliding_window_pattern": 0}, "_sliding_window_pattern", "must be a positive int"),
        ({"hidden_activation": "relu"}, "hidden_activation", "must be one of"),
        (
            {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": "1e6"}}},
            "key 'rope_parameters'['full_attention']: rope_theta",
            "got '1e6' (str)",
        ),
    ],
    "qwen3_moe": [
        ({"num_experts_per_tok": "3"}, "num_experts_per_tok", "must be a positive int"),
        ({"moe_intermediate_size": 0}, "moe_intermediate_size", "must be a positive int"),
        ({"mlp_only_layers": [LAYERS]}, "mlp_only_layers", f"a list of ints in [0, num_hidden_layers {LAYERS})"),
        ({"decoder_sparse_step": 1.5}, "decoder_sparse_step", "must be a positive int"),
        ({"norm_topk_prob": "true"}, "norm_topk_prob", "must be true or false"),
        ({"num_experts": -1}, "num_experts", "must be a non-negative int"),
    ],
    "gpt_oss": [
        ({"num_local_experts": "8"}, "num_local_experts", "must be a non-negative int"),
        ({"swiglu_limit": None}, "swiglu_limit", "must be a positive finite number, got null"),
        ({"sliding_window": 2.5}, "sliding_window", "must be a positive int or null"),
        ({"layer_types": "sliding_attention"}, "layer_types", "got 'sliding_attention' (str)"),
        ({"rope_parameters": {**hf_tiny.YARN, "beta_fast": "32"}}, "key 'rope_parameters': beta_fast", "(str)"),
    ],
}
TARGET_CASES = [
    pytest.param(family, edit, key, text, id=f"{family}-{next(iter(edit))}-{i}")
    for family in KINDS
    for i, (edit, key, text) in enumerate(COMMON + FAMILY[family])
]


def test_valid_tiny_configs_load(raw_configs):
    for family, raw in raw_configs.items():
        assert target_config(raw).model_type == family


@pytest.mark.parametrize("family,edit,key,text", TARGET_CASES)
def test_bad_target_field_names_the_file_and_key(family, edit, key, text, raw_configs, tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(_edited(raw_configs[family], edit)))
    with pytest.raises(ConfigError) as info:
        target_config(tmp_path)
    _assert_names(info.value, str(path), key, text)


def test_gemma3_wrapper_names_text_config_keys(raw_configs, tmp_path):
    path = tmp_path / "config.json"
    text = _edited(raw_configs["gemma3"], {"hidden_size": "64", "model_type": "gemma3_text"})
    path.write_text(json.dumps({"model_type": "gemma3", "architectures": ["X"], "text_config": text}))
    with pytest.raises(ConfigError) as info:
        target_config(path)
    _assert_names(info.value, str(path), "text_config.hidden_size must be a positive int, got '64' (str)")
    path.write_text(json.dumps({"model_type": "gemma3", "text_config": [1]}))
    with pytest.raises(ConfigError, match="text_config must be an object"):
        target_config(path)


def test_hidden_size_must_split_into_heads_when_head_dim_is_derived(raw_configs, tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(_edited(raw_configs["llama"], {"head_dim": DROP, "hidden_size": 66})))
    with pytest.raises(ConfigError) as info:
        target_config(path)
    _assert_names(info.value, str(path), "hidden_size 66 must be a multiple of num_attention_heads 4")


def test_generation_config_ids_are_checked_before_the_weights(raw_configs, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(raw_configs["llama"]))
    gen = tmp_path / "generation_config.json"
    for value, text in ((["1"], "got ['1'] (list)"), (VOCAB + 3, f"in [0, vocab_size {VOCAB})")):
        gen.write_text(json.dumps({"eos_token_id": value}))
        with pytest.raises(ConfigError) as info:  # a WeightsError (no safetensors) if it came later
            pj.load_target(tmp_path)
        _assert_names(info.value, str(gen), "eos_token_id", text)


# heads: (edit, what follows the file in the message's place, key, text); speculators edits of
# transformer_layer_config sit under "layer", the others are top-level keys
LAYER_WHERE = " key 'transformer_layer_config'"
AUX_WHERE = " key 'eagle_aux_hidden_state_layer_ids'"
HEAD_CASES = {
    "vllm": [
        ({"hidden_size": "32"}, "", "hidden_size", "must be a positive int, got '32' (str)"),
        ({"vocab_size": DROP}, "", "vocab_size", "missing key 'vocab_size'"),
        ({"num_key_value_heads": 3}, "", "num_attention_heads", "4 must be a multiple of num_key_value_heads 3"),
        ({"head_dim": 7}, "", "head_dim", "7 must be even"),
        ({"rms_norm_eps": "1e-5"}, "", "rms_norm_eps", "must be a positive finite number"),
        ({"rms_norm_eps": -1e-5}, "", "rms_norm_eps", "got -1e-05 (float)"),
        ({"rope_theta": 0}, "", "rope_theta", "must be a positive finite number"),
        ({"max_position_embeddings": 0}, "", "max_position_embeddings", "must be a positive int or null"),
        ({"attention_bias": 1}, "", "attention_bias", "must be true or false"),
        ({"hidden_act": "relu"}, "", "hidden_act", "must be one of"),
        ({k: V for k in ("mask_token_id", "pard_token", "ptd_token_id")}, "", "mask_token_id", f"[0, vocab_size {V})"),
        ({k: "61" for k in ("mask_token_id", "pard_token", "ptd_token_id")}, "", "mask_token_id", "got '61' (str)"),
        ({"draft_vocab_size": "40"}, "", "draft_vocab_size", "must be a positive int or null"),
        ({"target_hidden_size": 0}, "", "target_hidden_size", "must be a positive int or null"),
        ({"norm_before_residual": "true"}, "", "norm_before_residual", "must be true or false"),
        ({"peagle_jax": {"k_train": "5"}}, "", "peagle_jax.k_train", "must be a positive int or null"),
        (
            {"eagle_aux_hidden_state_layer_ids": [1, 3, -5], "eagle_config": {"use_aux_hidden_state": True}},
            AUX_WHERE,
            "eagle_aux_hidden_state_layer_ids",
            "expected 3 distinct non-negative ints",
        ),
    ],
    "speculators": [
        ({"layer": {"hidden_size": "32"}}, LAYER_WHERE, "hidden_size", "got '32' (str)"),
        ({"layer": {"num_attention_heads": 3}}, LAYER_WHERE, "num_attention_heads", "3 must be a multiple of"),
        ({"layer": {"rms_norm_eps": None}}, LAYER_WHERE, "rms_norm_eps", "got null"),
        ({"layer": {"max_position_embeddings": 64.0}}, LAYER_WHERE, "max_position_embeddings", "(float)"),
        ({"layer": {"fc_norm": "yes"}}, LAYER_WHERE, "fc_norm", "must be true or false"),
        (
            {"layer": {"rope_parameters": {"rope_type": "linear", "factor": "2"}}},
            LAYER_WHERE + " key 'rope_parameters'",
            "factor",
            "must be a positive finite number or null, got '2' (str)",
        ),
        ({"mask_token_id": V + 1}, "", "mask_token_id", f"[0, vocab_size {V}) or null, got {V + 1}"),
        ({"draft_vocab_size": 12.5}, "", "draft_vocab_size", "got 12.5 (float)"),
        ({"norm_output": "no"}, "", "norm_output", "must be true or false"),
        (
            {"speculators_config": {"proposal_methods": [{"speculative_tokens": "5"}]}},
            "",
            "speculators_config.proposal_methods[0].speculative_tokens",
            "must be a positive int or null, got '5' (str)",
        ),
        ({"eagle_aux_hidden_state_layer_ids": [1, 1, 5]}, AUX_WHERE, "eagle_aux_hidden_state_layer_ids", "3 distinct"),
    ],
}


def _head_config(fmt: str, edit: dict) -> dict:
    if fmt == "vllm":
        return _edited(vllm_config(), edit)
    edit = dict(edit)
    cfg = _edited(speculators_cfg(), {k: v for k, v in edit.items() if k != "layer"})
    cfg["transformer_layer_config"] = _edited(cfg["transformer_layer_config"], edit.get("layer", {}))
    return cfg


@pytest.mark.parametrize(
    "fmt,edit,suffix,key,text",
    [pytest.param(fmt, *case, id=f"{fmt}-{i}") for fmt, cases in HEAD_CASES.items() for i, case in enumerate(cases)],
)
def test_bad_head_field_names_the_file_and_key(fmt, edit, suffix, key, text, tmp_path):
    where = str(tmp_path / "config.json")
    read = read_vllm_config if fmt == "vllm" else read_speculators_config
    read(_head_config(fmt, {}), where)  # the unedited config is valid
    with pytest.raises(ConfigError) as info:
        read(_head_config(fmt, edit), where)
    _assert_names(info.value, where + suffix + ":", key, text)


def test_head_folder_error_names_its_config(tmp_path):
    folder = write_folder(tmp_path / "head", vllm_config(rms_norm_eps="tiny"), hand_tensors())
    with pytest.raises(ConfigError) as info:
        pj.load_drafter(folder)
    _assert_names(info.value, str(folder / "config.json"), "rms_norm_eps", "got 'tiny' (str)")


# tokenizer files
@pytest.mark.parametrize(
    "name,text,message",
    [
        ("tokenizer.json", "{not json", "tokenizer.json: unreadable tokenizer file, invalid JSON"),
        ("tokenizer.json", '{"version": "1.0", "model": {"type": "Nope"}}', "tokenizer.json: not a tokenizer"),
        ("tokenizer.json", "[]", "tokenizer.json: not a tokenizer the tokenizers library can read"),
        ("tokenizer_config.json", "{", "tokenizer_config.json: unreadable tokenizer file, invalid JSON"),
    ],
)
def test_corrupt_tokenizer_file_is_named(name, text, message, raw_configs, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(raw_configs["llama"]))
    if name != "tokenizer.json":
        (tmp_path / "tokenizer.json").write_text("{}")
    (tmp_path / name).write_text(text)
    with pytest.raises(ConfigError) as info:
        load_tokenizer(tmp_path)
    _assert_names(info.value, str(tmp_path / name), message.split(": ", 1)[1])


def test_no_tokenizer_files_is_none(tmp_path):
    assert load_tokenizer(tmp_path) is None


# end to end: python -m infer
def _one_error_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1 and lines[-1] == errors[0], stderr
    return errors[0]


def test_infer_cli_bad_target_config_is_one_line_exit_1(raw_configs, tmp_path):
    path = tmp_path / "target" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(_edited(raw_configs["qwen3"], {"hidden_size": "1024"})))
    proc = run_module("infer", ["generate", "--target", path.parent, "--mode", "none", "--prompt-ids", "1,2"])
    assert proc.returncode == 1, proc.stderr
    assert proc.stdout == ""
    line = _one_error_line(proc.stderr)
    assert line == f"error: {path}: hidden_size must be a positive int, got '1024' (str)"


def test_infer_cli_corrupt_tokenizer_is_one_line_exit_1(built, tmp_path):
    folder = shutil.copytree(built(KINDS["llama"])[0], tmp_path / "target")
    (folder / "tokenizer.json").write_text('{"truncated": ')
    proc = run_module("infer", ["generate", "--target", folder, "--mode", "none", "--prompt", "hi"])
    assert proc.returncode == 1, proc.stderr
    line = _one_error_line(proc.stderr)
    assert line.startswith(f"error: {folder / 'tokenizer.json'}: unreadable tokenizer file, invalid JSON ("), line
    target = pj.load_target(folder, dtype="float32")
    for _ in range(2):  # a failed load is not remembered as "no tokenizer"
        with pytest.raises(ConfigError, match="tokenizer.json"):
            _ = target.tokenizer


def test_infer_cli_bad_head_config_is_one_line_exit_1(built, tmp_path, capsys):
    folder = built(KINDS["llama"])[0]
    head = write_folder(tmp_path / "head", vllm_config(draft_vocab_size="40"), hand_tensors())
    argv = ["generate", "--target", str(folder), "--drafter", str(head), "--prompt-ids", "1,2", "--k", "2"]
    assert main(argv) == 1
    line = _one_error_line(capsys.readouterr().err)
    assert line.startswith(f"error: {head / 'config.json'}: draft_vocab_size must be a positive int or null"), line
