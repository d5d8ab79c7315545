"""Bad model folders and hostile templates fail with one clear error each."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from minengine.checkpoint.weights import load_state_dict
from minengine.config import ModelConfig
from minengine.errors import ConfigError, TokenizerError, WeightsError
from minengine.steps.load import load_model
from minengine.text.chat_template import Message, render_chat

CPU = torch.device("cpu")


def _copy(tiny_models, tmp_path, name="llama-gqa"):
    folder = tmp_path / "m"
    shutil.copytree(tiny_models[name][0], folder)
    return folder


def _edit_config(folder, **changes):
    path = folder / "config.json"
    raw = json.loads(path.read_text())
    raw.update(changes)
    path.write_text(json.dumps(raw))


@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        ({"model_type": "gpt2"}, "model_type 'gpt2' is not supported"),
        ({"num_local_experts": 8}, "MoE or MLA"),
        ({"kv_lora_rank": 512}, "MoE or MLA"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope scaling 'yarn'"),
        ({"sliding_window": 16, "use_sliding_window": True}, "sliding-window"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ],
)
def test_unsupported_configs_are_refused(tiny_models, tmp_path, changes, needle):
    folder = _copy(tiny_models, tmp_path)
    _edit_config(folder, **changes)
    with pytest.raises(ConfigError, match=needle) as info:
        ModelConfig.from_file(folder)
    assert "\n" not in str(info.value)


def test_mistral_window_longer_than_context_is_full_attention(tiny_models, tmp_path):
    folder = _copy(tiny_models, tmp_path, "mistral")
    _edit_config(folder, sliding_window=4096, max_position_embeddings=256)
    assert ModelConfig.from_file(folder).model_type == "mistral"


def _rewrite_weights(folder, mutate):
    from safetensors.torch import load_file, save_file

    tensors = load_file(folder / "model.safetensors")
    mutate(tensors)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


def test_missing_tensor_is_listed(tiny_models, tmp_path):
    folder = _copy(tiny_models, tmp_path)
    _rewrite_weights(folder, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(WeightsError, match=r"missing 1 tensor\(s\): model.layers.1.mlp.up_proj.weight"):
        load_state_dict(folder, ModelConfig.from_file(folder), torch.float32, CPU)


def test_wrong_shape_and_unexpected_tensor_are_listed(tiny_models, tmp_path):
    folder = _copy(tiny_models, tmp_path)

    def mutate(t):
        t["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(8, 64)
        t["model.layers.0.extra.weight"] = torch.zeros(2)

    _rewrite_weights(folder, mutate)
    with pytest.raises(WeightsError) as info:
        load_state_dict(folder, ModelConfig.from_file(folder), torch.float32, CPU)
    message = str(info.value)
    assert "wrong shape 1 tensor(s): model.layers.0.self_attn.k_proj.weight (8, 64) != (32, 64)" in message
    assert "unexpected 1 tensor(s): model.layers.0.extra.weight" in message
    assert "missing" not in message


def test_corrupted_safetensors_header(tiny_models, tmp_path):
    folder = _copy(tiny_models, tmp_path)
    path = folder / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[8:40] = b"{not json at all" + b" " * 16
    path.write_bytes(bytes(data))
    with pytest.raises(WeightsError, match="corrupted or truncated"):
        load_model(folder, ModelConfig.from_file(folder), torch.float32, CPU)


def test_pickle_checkpoint_is_refused(tiny_models, tmp_path):
    folder = _copy(tiny_models, tmp_path)
    (folder / "model.safetensors").unlink()
    torch.save({"x": torch.zeros(1)}, folder / "pytorch_model.bin")
    with pytest.raises(WeightsError, match="pickle checkpoints .* are refused"):
        load_state_dict(folder, ModelConfig.from_file(folder), torch.float32, CPU)


def test_sharded_checkpoint_loads(tiny_models, tmp_path):
    folder, hf = tiny_models["qwen3"]
    sharded = tmp_path / "sharded"
    hf.save_pretrained(sharded, safe_serialization=True, max_shard_size="60KB")
    assert (sharded / "model.safetensors.index.json").exists()
    cfg = ModelConfig.from_file(sharded)
    single = load_state_dict(folder, cfg, torch.float32, CPU)
    split = load_state_dict(sharded, cfg, torch.float32, CPU)
    assert single.keys() == split.keys()
    assert all(torch.equal(single[k], split[k]) for k in single)


@pytest.mark.parametrize(
    "template",
    [
        "{{ messages.__class__.__mro__[1].__subclasses__() }}",
        "{{ ''.__class__.__base__ }}",
        "{% set x = messages.append(1) %}{{ x }}",
    ],
)
def test_template_cannot_reach_python_internals(template):
    with pytest.raises(TokenizerError, match="unsafe operation"):
        render_chat(template, [Message("user", "hi")], add_generation_prompt=True, special_tokens={})


def test_template_private_attributes_render_as_nothing():
    # The sandbox answers unsafe attribute reads with an undefined value: nothing leaks.
    out = render_chat(
        "[{{ raise_exception.__globals__ }}][{{ messages.__len__ }}]",
        [Message("user", "hi")],
        add_generation_prompt=True,
        special_tokens={},
    )
    assert out == "[][]"


def test_template_raise_exception_is_a_clear_error():
    template = "{{ raise_exception('Conversation roles must alternate') }}"
    with pytest.raises(TokenizerError, match="roles must alternate"):
        render_chat(template, [Message("user", "hi")], add_generation_prompt=True, special_tokens={})


@pytest.mark.parametrize(
    ("template", "needle"),
    [
        ("{% if false %}x{% endif %}", "rendered nothing"),
        ("{{ range(10**8) | length }}", "Range too big"),
        ("{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}", "longer than"),
        ("{{ 'x' * 10**9 }}", "passed"),
        ("{{ 7 ** 99999999 }}", "power too large"),
        ("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", "recursed too deeply"),
        ("{{ messages[0].content / 0 }}", "failed to render"),
    ],
)
def test_runaway_and_broken_templates_stop_with_one_line(template, needle):
    with pytest.raises(TokenizerError, match=needle) as info:
        render_chat(template, [Message("user", "hi")], add_generation_prompt=True, special_tokens={})
    assert "\n" not in str(info.value)


def test_budgeted_range_behaves_like_range_in_real_templates():
    template = (
        "{% for i in range(messages | length) | reverse %}{{ messages[i].content }}{% endfor %}"
        "|{{ range(5)[1:3] | list }}|{{ 3 in range(5) }}|{{ range(4) | length }}|{{ 'ab' * 2 }}"
    )
    out = render_chat(template, [Message("user", "a"), Message("assistant", "b")], add_generation_prompt=True,
                      special_tokens={})  # fmt: skip
    assert out == "ba|[1, 2]|True|4|abab"


def test_a_folder_template_failure_names_the_file_and_exits_cleanly(chatty_tiny_dir, tmp_path, capsys):
    from reqscope.cli import main

    folder = tmp_path / "m"
    shutil.copytree(chatty_tiny_dir, folder)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = "{% if false %}{{ messages }}{% endif %}"
    config_path.write_text(json.dumps(config))
    code = main(["--plain", "--model", str(folder), "--max-tokens", "2", "hello"])
    err = capsys.readouterr().err
    assert code == 1
    assert f"{config_path}: the chat template rendered nothing" in err
    assert "Traceback" not in err
