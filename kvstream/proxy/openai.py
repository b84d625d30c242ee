"""The OpenAI-compatible request and error shapes the proxy and the emulated engine share.

No I/O: JSON bodies in, token ids and error bodies out. Errors have vLLM's server shape::

    {"error": {"message": "...", "type": "BadRequestError", "param": null, "code": 400}}

(``code`` is the HTTP status, as vLLM sets it). :class:`OpenAIError` carries the status;
the HTTP layers turn it into that body.
"""

from __future__ import annotations

from typing import Any, Mapping

import msgspec

from kvstream.errors import RemoteProtocolError
from kvstream.proxy.tokenize import ChatTemplateError, PromptTokenizer

__all__ = [
    "OpenAIError",
    "error_body",
    "parse_json_body",
    "read_body",
    "prompt_token_ids",
    "completion_prompts",
    "requested_model",
]

_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    405: "MethodNotAllowed",
    413: "BadRequestError",
    429: "RateLimitError",
    500: "InternalServerError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}


class OpenAIError(RemoteProtocolError):
    """A request the server refuses, with its HTTP ``status`` (4xx: the client's fault)."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param

    def body(self) -> dict[str, Any]:
        """The JSON error body (vLLM's shape)."""
        return error_body(self.status, self.message, self.param)


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    """``{"error": {"message", "type", "param", "code"}}`` for HTTP ``status``."""
    return {"error": {"message": message, "type": _TYPES.get(status, "BadRequestError" if status < 500 else
                                                               "InternalServerError"),
                      "param": param, "code": status}}


_decoder = msgspec.json.Decoder()
_TEMPLATE_ARGS = frozenset({"messages", "conversation", "special_tokens"})
"""Names the chat template call takes itself (``chat_template_kwargs`` cannot set them)."""


async def read_body(request: Any, max_bytes: int) -> bytes:
    """A Starlette request's body, read chunk by chunk; :class:`OpenAIError` 413 as soon as
    it passes ``max_bytes`` (bytes), so an oversized body is never held whole."""
    parts: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise OpenAIError(413, f"request body is over the limit of {max_bytes} bytes")
        parts.append(chunk)
    return b"".join(parts)


def parse_json_body(raw: bytes, max_bytes: int) -> dict[str, Any]:
    """The request's JSON object; :class:`OpenAIError` 400 for malformed JSON or a body that
    is not an object, 413 for a body over ``max_bytes`` (bytes)."""
    if len(raw) > max_bytes:
        raise OpenAIError(413, f"request body of {len(raw)} bytes is over the limit of {max_bytes} bytes")
    try:
        body = _decoder.decode(raw)
    except msgspec.DecodeError as exc:
        raise OpenAIError(400, f"JSON decode error: {exc}") from None
    except RecursionError:  # msgspec's nesting limit (about 1,000 levels)
        raise OpenAIError(400, "JSON decode error: the body nests arrays or objects too deeply") from None
    if not isinstance(body, dict):
        raise OpenAIError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def requested_model(body: Mapping[str, Any], served: str) -> str:
    """The ``model`` field, checked against the served name (None/absent means it).
    :class:`OpenAIError` 404 for another model, as vLLM answers."""
    model = body.get("model")
    if model is None:
        return served
    if model != served:
        raise OpenAIError(404, f"The model `{model}` does not exist.", "model")
    return served


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and all(type(t) is int and t >= 0 for t in value)


def prompt_token_ids(body: Mapping[str, Any], kind: str, tokenizer: PromptTokenizer | None) -> list[int]:
    """The prompt's token ids as the engine computes them.

    ``kind``: ``"completions"`` (``prompt``: text, token ids, or a one-element list of
    either) or ``"chat"`` (``messages`` rendered with the chat template; vLLM's
    ``add_generation_prompt``, ``continue_final_message`` and ``chat_template_kwargs``
    fields are honoured). ``tokenizer`` None: only token-id prompts are accepted.
    Raises :class:`OpenAIError` 400 for anything else.
    """
    if kind == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise OpenAIError(400, "'messages' must be a non-empty list of message objects", "messages")
        if tokenizer is None:
            raise OpenAIError(400, "chat requests need a tokenizer and chat template (start with --tokenizer)",
                              "messages")
        norm = []
        for m in messages:
            content = m.get("content")
            if isinstance(content, list):  # content parts: keep the text ones, in order
                content = "".join(str(p.get("text", "")) for p in content
                                  if isinstance(p, dict) and p.get("type") == "text")
            norm.append({**m, "content": "" if content is None else content})
        kwargs = body.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, dict):
            raise OpenAIError(400, "'chat_template_kwargs' must be an object", "chat_template_kwargs")
        taken = sorted(k for k in kwargs if k in _TEMPLATE_ARGS)
        if taken:  # vLLM's template call refuses these too (a TypeError, answered 400)
            raise OpenAIError(400, f"'chat_template_kwargs' may not set {', '.join(map(repr, taken))}",
                              "chat_template_kwargs")
        add_gen: Any = bool(body.get("add_generation_prompt", True))
        cont = bool(body.get("continue_final_message", False))
        if cont:
            add_gen = False
        # As vLLM merges them: the request's fields first, chat_template_kwargs over them.
        merged: dict[str, Any] = {"add_generation_prompt": add_gen, "tools": body.get("tools")}
        merged.update(kwargs)
        cont = bool(merged.pop("continue_final_message", cont))
        try:
            text = tokenizer.apply_chat_template(norm, **merged)
        except ChatTemplateError as exc:
            raise OpenAIError(400, str(exc), "messages") from None
        if cont:
            last = norm[-1].get("content")
            if isinstance(last, str) and last:
                cut = text.rfind(last)
                if cut >= 0:
                    text = text[: cut + len(last)]
        return tokenizer.encode(text, add_special_tokens=False)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and (isinstance(prompt[0], str) or _is_ids(prompt[0])):
        prompt = prompt[0]
    return _one_prompt(prompt, tokenizer)


def completion_prompts(body: Mapping[str, Any], tokenizer: PromptTokenizer | None) -> list[list[int]]:
    """The token ids of every prompt of a completion request, in order: ``prompt`` is one
    prompt (text or token ids) or a batch (a list of texts or of token-id lists, as vLLM
    takes them: one choice per prompt). Raises :class:`OpenAIError` 400 otherwise."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) or (isinstance(p, list) and p and _is_ids(p))
                                                   for p in prompt):
        return [_one_prompt(p, tokenizer) for p in prompt]
    return [_one_prompt(prompt, tokenizer)]


def _one_prompt(prompt: Any, tokenizer: PromptTokenizer | None) -> list[int]:
    if isinstance(prompt, str):
        if tokenizer is None:
            raise OpenAIError(400, "text prompts need a tokenizer (start with --tokenizer) or send token ids",
                              "prompt")
        ids = tokenizer.encode(prompt, add_special_tokens=True)
    elif isinstance(prompt, list) and _is_ids(prompt):
        ids = list(prompt)
    else:
        raise OpenAIError(400, "'prompt' must be a string, a list of token ids, or a list of either (a batch)",
                          "prompt")
    if not ids:
        raise OpenAIError(400, "the prompt is empty; give at least one token", "prompt")
    return ids
