"""Local tokenization and chat templates, on small real tokenizer files built here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, processors

from kvstream.proxy.openai import OpenAIError, prompt_token_ids
from kvstream.proxy.tokenize import (ByteTokenizer, ChatTemplateError, HFTokenizer, TokenizerError,
                                     load_tokenizer, render_chat_template)

WORDS = ["hello", "there", "how", "are", "you", "user", "assistant", "system", "be", "brief", "[INST]", "[/INST]",
         "<<SYS>>", "<</SYS>>", "fine"]
SPECIALS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]

# Qwen/ChatML style (no BOS, special tokens written by the template).
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

# Llama-2 style: BOS from the template, roles must alternate (raise_exception), system folded in.
LLAMA2 = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
    "{% set system_message = false %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\n' + system_message + '\n<</SYS>>\n\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' ' + content.strip() + ' ' + eos_token }}{% endif %}"
    "{% endfor %}"
)


def _model_dir(tmp_path: Path, name: str, template: str, *, bos: bool, as_list: bool = False) -> Path:
    vocab = {t: i for i, t in enumerate(SPECIALS + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(SPECIALS)
    if bos:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    folder = tmp_path / name
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    cfg = {"bos_token": {"content": "<s>", "lstrip": False}, "eos_token": "</s>",
           "chat_template": [{"name": "default", "template": template}] if as_list else template}
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    return folder


def ids(*tokens: str) -> list[int]:
    table = {t: i for i, t in enumerate(SPECIALS + WORDS)}
    return [table[t] for t in tokens]


def test_chatml_template_renders_known_token_ids(tmp_path: Path) -> None:
    tok = HFTokenizer(_model_dir(tmp_path, "qwenish", CHATML, bos=False))
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    body = {"messages": msgs}
    assert prompt_token_ids(body, "chat", tok) == ids(
        "<|im_start|>", "system", "be", "brief", "<|im_end|>",
        "<|im_start|>", "user", "hello", "there", "<|im_end|>",
        "<|im_start|>", "assistant")
    # add_generation_prompt=False (vLLM's request field) leaves the assistant header out.
    assert prompt_token_ids({**body, "add_generation_prompt": False}, "chat", tok)[-1] == ids("<|im_end|>")[0]


def test_llama2_template_uses_bos_from_config_and_raises_on_bad_roles(tmp_path: Path) -> None:
    tok = HFTokenizer(_model_dir(tmp_path, "llamaish", LLAMA2, bos=True, as_list=True))
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "how are you"},
            {"role": "assistant", "content": "fine"}, {"role": "user", "content": "hello"}]
    # The template writes <s> itself; the chat path must not add a second BOS.
    assert prompt_token_ids({"messages": msgs}, "chat", tok) == ids(
        "<s>", "[INST]", "<<SYS>>", "be", "brief", "<</SYS>>", "how", "are", "you", "[/INST]",
        "fine", "</s>", "<s>", "[INST]", "hello", "[/INST]")
    # A completion prompt gets the post-processor's BOS.
    assert prompt_token_ids({"prompt": "hello there"}, "completions", tok) == ids("<s>", "hello", "there")
    with pytest.raises(OpenAIError) as err:
        prompt_token_ids({"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]},
                         "chat", tok)
    assert err.value.status == 400 and "must alternate" in err.value.message


def test_token_id_prompts_need_no_tokenizer_and_text_does() -> None:
    assert prompt_token_ids({"prompt": [5, 6, 7]}, "completions", None) == [5, 6, 7]
    assert prompt_token_ids({"prompt": [[5, 6]]}, "completions", None) == [5, 6]
    for body in ({"prompt": "hi"}, {"prompt": ["a", "b"]}, {"prompt": []}, {"prompt": [1, -2]}):
        with pytest.raises(OpenAIError) as err:
            prompt_token_ids(body, "completions", None)
        assert err.value.status == 400


def test_byte_tokenizer_round_trips_and_renders_chatml() -> None:
    tok = ByteTokenizer()
    assert tok.decode(tok.encode("héllo")) == "héllo"
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_bad_tokenizer_paths_and_templates_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match="no tokenizer at"):
        load_tokenizer(tmp_path / "missing")
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not json")
    with pytest.raises(TokenizerError, match="not a valid tokenizer.json"):
        load_tokenizer(bad)
    with pytest.raises(ChatTemplateError, match="does not compile"):
        render_chat_template("{% for %}", [])


def test_chat_template_kwargs_override_the_request_fields_as_vllm_merges_them(tmp_path: Path) -> None:
    # vLLM (serving_chat, LLM.chat): dict(add_generation_prompt=..., tools=...) then
    # .update(chat_template_kwargs). Before: a TypeError (multiple values), a 500.
    tok = HFTokenizer(_model_dir(tmp_path, "qwenish", CHATML, bos=False))
    msgs = [{"role": "user", "content": "hello there"}]
    plain = prompt_token_ids({"messages": msgs, "add_generation_prompt": False}, "chat", tok)
    assert prompt_token_ids({"messages": msgs, "chat_template_kwargs": {"add_generation_prompt": False}},
                            "chat", tok) == plain
    assert prompt_token_ids({"messages": msgs, "chat_template_kwargs": {"tools": None}}, "chat", tok)[-1] == \
        ids("assistant")[0]


@pytest.mark.parametrize("key", ["messages", "special_tokens"])
def test_chat_template_kwargs_cannot_set_the_template_calls_own_arguments(tmp_path: Path, key: str) -> None:
    tok = HFTokenizer(_model_dir(tmp_path, "qwenish", CHATML, bos=False))
    with pytest.raises(OpenAIError) as err:
        prompt_token_ids({"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {key: 1}},
                         "chat", tok)
    assert err.value.status == 400 and key in err.value.message
