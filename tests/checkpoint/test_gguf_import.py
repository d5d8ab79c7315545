"""`convert_gguf` and `reqscope import`: weights, config and tokenizer survive the trip from GGUF.

Tiny GGUFs exported from random transformers models (tests/tiny_gguf.py) must come back with
the source model's logits. A reference forward written against llama.cpp's conventions
(interleaved RoPE on the GGUF's own rows) checks the Q/K un-permutation independently of the
export. The slow tests do the same checks on the real default model.
"""

from __future__ import annotations

import copy
import json
import math
import os
from pathlib import Path

import pytest
import regex
import torch
from gguf import GGUFReader
from gguf.quants import dequantize
from safetensors import safe_open
from tiny_gguf import CHAT_TEMPLATE, ROPE_THETA, TinyGGUF, reference_state_dict, write_tiny_gguf
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer

from minengine.checkpoint.shards import INDEX_FILE, write_checkpoint
from minengine.errors import ConfigError, ModelNotFoundError, ReqscopeError, TokenizerError
from minengine.gguf.convert import convert_gguf
from minengine.progress import PullProgress
from reqscope.cli import main

IDS = [1, 20, 75, 140, 201, 266, 269, 2, 9, 33, 100]
KYOTO = "Show me wheelchair-accessible hotels in Kyoto"
# A real llama/qwen2 GGUF (e.g. the default model's) to run the llama.cpp-reference check on.
REAL_GGUF = os.environ.get("REQSCOPE_TEST_GGUF")


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> tuple[TinyGGUF, Path]:
    """Untied tiny llama with a Q8_0 embedding and a Q8_0 MLP matrix, and its converted folder."""
    root = tmp_path_factory.mktemp("llama")
    q8 = ("model.embed_tokens.weight", "model.layers.1.mlp.up_proj.weight")
    tiny = write_tiny_gguf(root / "tiny.gguf", "llama", q8_0=q8)
    return tiny, convert_gguf(tiny.path, root / "out")


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory) -> tuple[TinyGGUF, Path]:
    """Tied tiny qwen2 (q/k/v biases, Qwen's pre-tokenizer) and its converted folder."""
    root = tmp_path_factory.mktemp("qwen2")
    tiny = write_tiny_gguf(root / "tiny.gguf", "qwen2", tied=True, pre="qwen2", seed=1)
    return tiny, convert_gguf(tiny.path, root / "out")


def _logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_converted_folder_reproduces_source_logits(family, request):
    tiny, folder = request.getfixturevalue(family)
    reference = copy.deepcopy(tiny.model)
    reference.load_state_dict(reference_state_dict(tiny))
    converted = AutoModelForCausalLM.from_pretrained(folder)

    expected = _logits(reference, IDS)
    assert torch.allclose(_logits(converted, IDS), expected, atol=1e-5, rtol=0)
    if tiny.quantized:  # the Q8_0 rounding is real, so the match above is not vacuous
        assert (expected - _logits(tiny.model, IDS)).abs().max() > 1e-4


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_config_carries_the_gguf_hyper_parameters(family, request):
    tiny, folder = request.getfixturevalue(family)
    config = json.loads((folder / "config.json").read_text())
    source = tiny.model.config
    assert config["model_type"] == family
    assert config["architectures"] == [type(tiny.model).__name__]
    assert config["tie_word_embeddings"] is (family == "qwen2")
    assert config["rope_theta"] == ROPE_THETA
    assert config["rms_norm_eps"] == 1e-6
    sizes = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    for key in (*sizes, "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings"):
        assert config[key] == getattr(source, key), key
    assert config["torch_dtype"] == "float32"
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    assert json.loads((folder / "generation_config.json").read_text())["eos_token_id"] == 2
    with safe_open(str(folder / "model.safetensors"), "pt") as weights:
        assert ("lm_head.weight" in weights.keys()) is (family == "llama")  # noqa: SIM118


def _llama_cpp_forward(path: Path, ids: list[int]) -> torch.Tensor:
    """Logits computed the way llama.cpp does, on the GGUF's tensors exactly as stored."""
    reader = GGUFReader(path)

    def meta(key: str):
        return reader.fields[key].contents()

    arch = meta("general.architecture")
    w = {
        t.name: torch.from_numpy(dequantize(t.data, t.tensor_type).copy()).double()
        for t in reader.tensors
    }
    n_head, n_kv = meta(f"{arch}.attention.head_count"), meta(f"{arch}.attention.head_count_kv")
    eps = meta(f"{arch}.attention.layer_norm_rms_epsilon")
    hidden = meta(f"{arch}.embedding_length")
    head_dim = hidden // n_head
    inv_freq = meta(f"{arch}.rope.freq_base") ** (-torch.arange(0, head_dim, 2).double() / head_dim)
    angles = torch.arange(len(ids)).double()[:, None] * inv_freq[None]
    cos, sin = angles.cos()[:, None], angles.sin()[:, None]

    def rope(t: torch.Tensor) -> torch.Tensor:
        if arch == "llama":  # llama.cpp's "normal" RoPE rotates adjacent pairs
            a, b = t[..., 0::2], t[..., 1::2]
            return torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2)
        a, b = t[..., : head_dim // 2], t[..., head_dim // 2 :]  # NEOX: halves
        return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)

    def norm(t: torch.Tensor, gain: torch.Tensor) -> torch.Tensor:
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + eps) * gain

    def linear(t: torch.Tensor, name: str) -> torch.Tensor:
        out = t @ w[f"{name}.weight"].T
        return out + w[f"{name}.bias"] if f"{name}.bias" in w else out

    x = w["token_embd.weight"][ids]
    mask = torch.full((len(ids), len(ids)), float("-inf")).triu(1).double()
    for layer in range(meta(f"{arch}.block_count")):
        p = f"blk.{layer}"
        h = norm(x, w[f"{p}.attn_norm.weight"])
        q = rope(linear(h, f"{p}.attn_q").view(len(ids), n_head, head_dim))
        k = rope(linear(h, f"{p}.attn_k").view(len(ids), n_kv, head_dim))
        v = linear(h, f"{p}.attn_v").view(len(ids), n_kv, head_dim)
        k, v = (t.repeat_interleave(n_head // n_kv, dim=1) for t in (k, v))
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(head_dim) + mask
        attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(len(ids), hidden)
        x = x + linear(attn, f"{p}.attn_output")
        h = norm(x, w[f"{p}.ffn_norm.weight"])
        gate = torch.nn.functional.silu(linear(h, f"{p}.ffn_gate"))
        x = x + linear(gate * linear(h, f"{p}.ffn_up"), f"{p}.ffn_down")
    head = w.get("output.weight", w["token_embd.weight"])
    return (norm(x, w["output_norm.weight"]) @ head.T).float()


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_converted_folder_matches_llama_cpp_semantics(family, request):
    tiny, folder = request.getfixturevalue(family)
    converted = AutoModelForCausalLM.from_pretrained(folder)
    assert torch.allclose(_logits(converted, IDS), _llama_cpp_forward(tiny.path, IDS), atol=1e-5)


@pytest.mark.skipif(not REAL_GGUF, reason="set REQSCOPE_TEST_GGUF to a real GGUF file")
def test_real_gguf_matches_llama_cpp_semantics(tmp_path):
    folder = convert_gguf(REAL_GGUF, tmp_path / "out")
    converted = AutoModelForCausalLM.from_pretrained(folder)
    ids = AutoTokenizer.from_pretrained(folder)(KYOTO).input_ids
    assert torch.allclose(_logits(converted, ids), _llama_cpp_forward(REAL_GGUF, ids), atol=2e-4)


def test_tokenizer_uses_the_gguf_vocabulary_and_merges(llama):
    tiny, folder = llama
    saved = json.loads((folder / "tokenizer.json").read_text())
    assert saved["model"]["vocab"] == {t: i for i, t in enumerate(tiny.vocab.tokens)}
    assert [" ".join(m) for m in saved["model"]["merges"]] == list(tiny.vocab.merges)
    specials = {t["content"]: t["special"] for t in saved["added_tokens"]}
    assert specials == {"<|endoftext|>": True, "<|im_start|>": True, "<|im_end|>": True,
                        "<tool>": False}  # fmt: skip


def test_tokenizer_ids_follow_the_merges(llama):
    tiny, folder = llama
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    vocab = tiny.vocab
    assert tok.encode("hello world").ids == [vocab.id_of("hello"), vocab.id_of("Ġworld")]
    # smollm splits digits one by one, before the byte-level regex sees them
    assert tok.encode("x 42").ids == [vocab.id_of(c) for c in ("x", "Ġ", "4", "2")]
    assert tok.encode("<|im_start|>hello<tool>").ids == [
        1,
        vocab.id_of("hello"),
        vocab.id_of("<tool>"),
    ]
    for text in ("京都 hotels 🏨", "  two  spaces\n\nnewline\ttab", "émoji 🚀!"):
        assert tok.decode(tok.encode(text).ids) == text


def test_qwen2_tokenizer_normalizes_and_keeps_digit_groups_apart(qwen2):
    tiny, folder = qwen2
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    assert tok.encode("e\u0301").ids == tok.encode("\u00e9").ids  # NFC
    assert tok.encode("hello world").ids == [tiny.vocab.id_of("hello"), tiny.vocab.id_of("Ġworld")]
    assert len(tok.encode("2024").ids) == 4


def test_transformers_tokenizer_renders_the_gguf_chat_template(llama):
    _, folder = llama
    tok = AutoTokenizer.from_pretrained(folder)
    text = tok.apply_chat_template(
        [{"role": "user", "content": "hello"}], add_generation_prompt=True, tokenize=False
    )
    assert text == "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == (
        "<|im_start|>",
        "<|im_end|>",
        "<|im_end|>",
    )
    assert (
        json.loads((folder / "tokenizer_config.json").read_text())["chat_template"] == CHAT_TEMPLATE
    )


def test_bfloat16_output(tmp_path):
    tiny = write_tiny_gguf(tmp_path / "tiny.gguf", "llama")
    folder = convert_gguf(tiny.path, tmp_path / "out", dtype="bfloat16")
    assert json.loads((folder / "config.json").read_text())["torch_dtype"] == "bfloat16"
    with safe_open(str(folder / "model.safetensors"), "pt") as weights:
        down = weights.get_tensor("model.layers.0.mlp.down_proj.weight")
    source = tiny.model.state_dict()["model.layers.0.mlp.down_proj.weight"]
    assert down.dtype == torch.bfloat16
    assert torch.equal(down, source.to(torch.bfloat16))


def test_unsupported_architecture_is_named(tmp_path):
    tiny = write_tiny_gguf(tmp_path / "mamba.gguf", "llama", architecture="mamba")
    with pytest.raises(ConfigError, match="'mamba'"):
        convert_gguf(tiny.path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_unknown_pre_tokenizer_is_refused(tmp_path):
    tiny = write_tiny_gguf(tmp_path / "odd.gguf", "llama", pre="deepseek-coder")
    with pytest.raises(TokenizerError, match="deepseek-coder"):
        convert_gguf(tiny.path, tmp_path / "out")


def test_existing_output_folder_is_never_overwritten(llama, tmp_path):
    tiny, _ = llama
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    with pytest.raises(ReqscopeError, match="not empty"):
        convert_gguf(tiny.path, out)
    assert [p.name for p in out.iterdir()] == ["notes.txt"]
    empty = tmp_path / "empty"
    empty.mkdir()
    assert (convert_gguf(tiny.path, empty) / "model.safetensors").is_file()


def test_interrupted_conversion_leaves_nothing(llama, tmp_path):
    tiny, _ = llama

    def interrupt(event: PullProgress) -> None:
        if event.stage == "convert" and event.done == 5:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        convert_gguf(tiny.path, tmp_path / "out", progress=interrupt)
    assert list(tmp_path.iterdir()) == []


def test_missing_and_malformed_inputs(tmp_path):
    with pytest.raises(ModelNotFoundError, match="no GGUF file"):
        convert_gguf(tmp_path / "absent.gguf", tmp_path / "out")
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"definitely not a gguf file")
    with pytest.raises(ReqscopeError, match="not a readable GGUF"):
        convert_gguf(junk, tmp_path / "out")


def test_sharded_checkpoint_round_trips(tmp_path):
    torch.manual_seed(0)
    tensors = {f"t{i}": torch.randn(64, 32) for i in range(5)}  # 8 KiB each
    paths = write_checkpoint(tensors.items(), tmp_path, max_shard_bytes=20_000)
    assert [p.name for p in paths] == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    assert index["metadata"]["total_size"] == 5 * 64 * 32 * 4
    for name, expected in tensors.items():
        with safe_open(str(tmp_path / index["weight_map"][name]), "pt") as shard:
            assert torch.equal(shard.get_tensor(name), expected)


def test_import_command(llama, tmp_path, capsys):
    tiny, _ = llama
    assert main(["import", str(tiny.path), str(tmp_path / "out")]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "out")
    assert main(["import", str(tiny.path), str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("reqscope: error:") and "not empty" in err and "\n" not in err


# --- the real default model -------------------------------------------------------------------


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars, strict=True)}


_GPT2_SPLIT = regex.compile(
    r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
)


def _smollm_reference_ids(text: str, vocab: dict[str, int], merges: list[str]) -> list[int]:
    """Textbook byte-level BPE with SmolLM2's splitting, independent of `tokenizers`."""
    ranks = {tuple(m.split(" ")): rank for rank, m in enumerate(merges)}
    table = _bytes_to_unicode()
    ids: list[int] = []
    for chunk in regex.split(r"(\p{N})", text):  # each digit is its own piece
        for piece in _GPT2_SPLIT.findall(chunk):
            word = [table[b] for b in piece.encode("utf-8")]
            while len(word) > 1:
                pairs = [
                    (ranks.get(pair, math.inf), i)
                    for i, pair in enumerate(zip(word, word[1:], strict=False))
                ]
                rank, i = min(pairs)
                if rank == math.inf:
                    break
                word[i : i + 2] = [word[i] + word[i + 1]]
            ids += [vocab[symbol] for symbol in word]
    return ids


@pytest.mark.slow
def test_default_model_tokenizer_matches_reference_bpe(default_model_dir):
    tok = AutoTokenizer.from_pretrained(default_model_dir)
    saved = json.loads((default_model_dir / "tokenizer.json").read_text())
    vocab, merges = saved["model"]["vocab"], [" ".join(m) for m in saved["model"]["merges"]]
    assert (len(vocab), len(merges)) == (49152, 48900)
    texts = [
        KYOTO,
        "Hello world 12345",
        "京都 hotels 🏨🚀",
        "  leading spaces\n\nnew\ttab",
        "it's 3.14!",
    ]
    for text in texts:
        ids = tok(text).input_ids
        assert ids == _smollm_reference_ids(text, vocab, merges), text
        assert tok.decode(ids) == text
    # ids read off the GGUF's own token list
    assert tok("Hello world 12345").input_ids == [19556, 905, 216, 33, 34, 35, 36, 37]
    assert tok("京都").input_ids == [16736, 122, 180, 38466]
    assert tok("<|im_start|>user\n").input_ids == [1, 4093, 198]


@pytest.mark.slow
def test_default_model_loads_in_transformers_and_renders_chatml(default_model_dir):
    tok = AutoTokenizer.from_pretrained(default_model_dir)
    text = tok.apply_chat_template(
        [{"role": "user", "content": KYOTO}], add_generation_prompt=True, tokenize=False
    )
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
        f"<|im_end|>\n<|im_start|>user\n{KYOTO}<|im_end|>\n<|im_start|>assistant\n"
    )
    assert (tok.eos_token, tok.convert_tokens_to_ids(tok.eos_token)) == ("<|im_end|>", 2)
    model = AutoModelForCausalLM.from_pretrained(default_model_dir)
    config = model.config
    assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads) == (
        30,
        9,
        3,
    )
    assert config.tie_word_embeddings and config.rope_parameters["rope_theta"] == 100000.0
    # Predictable text: the converted model reads each at about 1.3 nats per token, while the
    # same weights with Q/K rows left in GGUF order score about 2.4.
    for text in (
        "One, two, three, four, five, six, seven, eight, nine, ten.",
        "The capital of France is Paris. The capital of Germany is Berlin. "
        "The capital of Italy is Rome.",
    ):
        ids = tok(text, return_tensors="pt").input_ids
        with torch.no_grad():
            loss = model(ids, labels=ids).loss.item()
        assert loss < 1.8, (text, loss)
