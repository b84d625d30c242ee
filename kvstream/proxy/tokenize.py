"""Local tokenization and chat templates: prompt text and chat messages to token ids.

A KV-aware router must see the token ids the engine will see, so it tokenizes exactly as
the engine does (vLLM):

* completions: ``prompt`` text -> ``tokenizer.encode(text, add_special_tokens=True)``
  (BOS added if the tokenizer's post-processor adds it); a ``prompt`` of token ids is used
  as is (no tokenizer needed);
* chat: ``messages`` -> the model's chat template rendered with ``jinja2`` the way
  ``transformers``' ``apply_chat_template`` renders it (sandboxed environment,
  ``trim_blocks``/``lstrip_blocks``, the ``raise_exception`` and ``strftime_now`` helpers,
  a ``tojson`` filter that keeps non-ASCII, the tokenizer's special tokens as variables,
  ``add_generation_prompt``), then ``encode(text, add_special_tokens=False)`` (the template
  writes the special tokens itself).

:class:`HFTokenizer` loads a Hugging Face ``tokenizer.json`` (with the ``tokenizers``
library) and ``tokenizer_config.json`` / ``chat_template.jinja`` from a model folder; it
never downloads anything. :class:`ByteTokenizer` is the tokenizer-less fallback (UTF-8
bytes are the token ids) used by the emulated engine when it is given no tokenizer.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any, Mapping, Protocol, Sequence

from kvstream.errors import LocalProtocolError, RemoteProtocolError

__all__ = [
    "ByteTokenizer",
    "ChatTemplateError",
    "DEFAULT_CHAT_TEMPLATE",
    "HFTokenizer",
    "PromptTokenizer",
    "TokenizerError",
    "load_tokenizer",
    "render_chat_template",
]


class TokenizerError(LocalProtocolError, ValueError):
    """A tokenizer (files or folder) cannot be loaded; the message names the path and the fix."""


class ChatTemplateError(RemoteProtocolError, ValueError):
    """A chat request cannot be rendered: no template, a template syntax error, or the
    template itself refused the messages (``raise_exception``). Bad *input* from the
    client, reported as HTTP 400."""


DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
"""A ChatML template, used when a tokenizer has none (the byte tokenizer)."""


class PromptTokenizer(Protocol):
    """What the proxy and the emulated engine need from a tokenizer."""

    @property
    def vocab_size(self) -> int:
        """Token ids are in ``range(vocab_size)``."""
        ...

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids`` (special tokens skipped)."""
        ...

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        """The chat prompt text of ``messages``."""
        ...


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    # transformers overrides jinja's tojson: it must not HTML-escape and keeps non-ASCII.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


_ENV_CACHE: dict[str, Any] = {}


def _compiled(template: str) -> Any:
    hit = _ENV_CACHE.get(template)
    if hit is not None:
        return hit
    try:
        from jinja2 import TemplateError
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as exc:  # pragma: no cover - jinja2 is a dependency
        raise ChatTemplateError("chat templates need jinja2: pip install jinja2") from exc
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        compiled = env.from_string(template)
    except TemplateError as exc:
        raise ChatTemplateError(f"the chat template does not compile: {exc}") from None
    if len(_ENV_CACHE) > 32:
        _ENV_CACHE.clear()
    _ENV_CACHE[template] = compiled
    return compiled


def render_chat_template(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    special_tokens: Mapping[str, str] | None = None,
    **kwargs: Any,
) -> str:
    """Render ``messages`` with a Jinja chat ``template`` as ``apply_chat_template`` does.

    ``special_tokens``: ``bos_token``, ``eos_token``, ... made available to the template.
    ``kwargs`` (``tools``, ``documents``, ``enable_thinking``, ...) are passed to it too.
    Raises :class:`ChatTemplateError` when the template fails or refuses the messages.
    """
    from jinja2 import TemplateError

    compiled = _compiled(template)
    variables: dict[str, Any] = dict(special_tokens or {})
    variables.update(kwargs)
    try:
        return str(compiled.render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                   **variables))
    except ChatTemplateError:
        raise
    except TemplateError as exc:
        raise ChatTemplateError(f"the chat template failed on these messages: {exc}") from None
    except (TypeError, KeyError, AttributeError, ValueError) as exc:
        raise ChatTemplateError(f"the chat template failed on these messages: {type(exc).__name__}: {exc}") from None


class ByteTokenizer:
    """UTF-8 bytes as token ids (vocabulary of 256), with :data:`DEFAULT_CHAT_TEMPLATE`.

    The emulated engine's tokenizer when it is given none: deterministic, needs no files,
    and round-trips text (``decode(encode(t)) == t``).
    """

    vocab_size = 256
    chat_template = DEFAULT_CHAT_TEMPLATE

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The UTF-8 bytes of ``text`` (there are no special tokens)."""
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        """Text of byte ids (ids above 255 are taken modulo 256; bad UTF-8 is replaced)."""
        return bytes(i & 0xFF for i in ids).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        """ChatML text of ``messages``."""
        return render_chat_template(self.chat_template, messages, add_generation_prompt=add_generation_prompt,
                                    **kwargs)


def _token_text(value: Any) -> str | None:
    # tokenizer_config.json stores special tokens as strings or as AddedToken dicts.
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


class HFTokenizer:
    """A Hugging Face tokenizer from local files, with its chat template.

    Args:
        path: a ``tokenizer.json`` file or a model folder holding one (and optionally
            ``tokenizer_config.json`` and ``chat_template.jinja``).
        chat_template: overrides the model's template (Jinja text).

    Attributes: ``chat_template`` (None if the model has none), ``special_tokens`` (the
    ``*_token`` strings of ``tokenizer_config.json``), ``path``.
    """

    def __init__(self, path: str | Path, *, chat_template: str | None = None) -> None:
        try:
            from tokenizers import Tokenizer
        except ImportError as exc:  # pragma: no cover - tokenizers is a dependency
            raise TokenizerError("local tokenization needs the tokenizers package: pip install tokenizers") from exc
        p = Path(path)
        folder = p if p.is_dir() else p.parent
        file = p / "tokenizer.json" if p.is_dir() else p
        if not file.is_file():
            raise TokenizerError(
                f"no tokenizer at {str(path)!r}: give a tokenizer.json file or a model folder that holds one "
                "(nothing is downloaded)")
        try:
            self._tok = Tokenizer.from_file(str(file))
        except Exception as exc:  # noqa: BLE001 - the library raises plain Exception
            raise TokenizerError(f"{str(file)!r} is not a valid tokenizer.json: {exc}") from None
        self.path = file
        config: dict[str, Any] = {}
        cfg_file = folder / "tokenizer_config.json"
        if cfg_file.is_file():
            try:
                config = json.loads(cfg_file.read_text(encoding="utf-8"))
            except (OSError, ValueError) as exc:
                raise TokenizerError(f"{str(cfg_file)!r} is not valid JSON: {exc}") from None
        self.special_tokens: dict[str, str] = {}
        for name in _SPECIAL_NAMES:
            text = _token_text(config.get(name))
            if text is not None:
                self.special_tokens[name] = text
        template = chat_template
        if template is None:
            jinja_file = folder / "chat_template.jinja"
            raw = config.get("chat_template")
            if jinja_file.is_file():
                template = jinja_file.read_text(encoding="utf-8")
            elif isinstance(raw, str):
                template = raw
            elif isinstance(raw, list):  # named templates: [{"name": ..., "template": ...}]
                named = {t.get("name"): t.get("template") for t in raw if isinstance(t, Mapping)}
                template = named.get("default") or next(iter(named.values()), None)
        self.chat_template: str | None = template

    @property
    def vocab_size(self) -> int:
        """Size of the vocabulary, added tokens included."""
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` applies the post-processor (BOS...)."""
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``, special tokens skipped."""
        return str(self._tok.decode(list(ids), skip_special_tokens=True))

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        """The chat prompt text; raises :class:`ChatTemplateError` if the model has no
        template or the template refuses the messages."""
        if self.chat_template is None:
            raise ChatTemplateError(
                f"the tokenizer at {str(self.path)!r} has no chat template (tokenizer_config.json "
                "'chat_template' or chat_template.jinja); give one or use /v1/completions")
        return render_chat_template(self.chat_template, messages, add_generation_prompt=add_generation_prompt,
                                    special_tokens=self.special_tokens, **kwargs)


def load_tokenizer(path: str | Path | None, *, chat_template: str | None = None) -> PromptTokenizer:
    """:class:`HFTokenizer` for a path, :class:`ByteTokenizer` for None. ``chat_template``:
    a Jinja template text, or a path to a file holding one."""
    if chat_template is not None and "{" not in chat_template and Path(chat_template).is_file():
        chat_template = Path(chat_template).read_text(encoding="utf-8")
    if path is None:
        tok = ByteTokenizer()
        if chat_template is not None:
            tok.chat_template = chat_template
        return tok
    return HFTokenizer(path, chat_template=chat_template)
