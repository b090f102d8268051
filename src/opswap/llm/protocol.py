"""OpenAI's request bodies for the server (chapter 29), checked and turned into what the
engine takes: token-id prompts and SamplingParams, with one sentence per refusal.

`prepare_completion` and `prepare_chat` raise BadRequest (a 400, or a 404 for another
model's name) before anything reaches the engine: text without a tokenizer, a prompt
longer than max_model_len allows (naming the limit), a token outside the vocabulary,
options the server does not have (n > 1, echo, best_of, suffix, presence and frequency
penalties), and SamplingParams' own checks (temperature < 0, top_p outside (0, 1], ...).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict

from opswap.errors import OpswapError
from opswap.llm.sampling import SamplingError, SamplingParams, TokenLogprob


class BadRequest(OpswapError):
    """A request the server refuses; `status` is the HTTP status (400 unless said)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")  # OpenAI clients send fields we ignore

    model: str | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool = False
    ignore_eos: bool = False


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str | list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class ChatRequest(_Common):
    messages: list[dict[str, Any]]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


@dataclass
class Prepared:
    """A request ready for the driver: one token-id list per prompt, the same params."""

    prompts: list[list[int]]
    params: SamplingParams
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    logprobs: bool
    return_token_ids: bool


def _common_checks(body: _Common, model_name: str) -> None:
    if body.model is not None and body.model != model_name:
        raise BadRequest(
            f"the model {body.model!r} does not exist; this server serves {model_name!r}.", 404
        )
    if body.n != 1:
        raise BadRequest(f"n must be 1 (one choice per prompt), got {body.n}.")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(body, name):
            raise BadRequest(f"{name} is not supported; use repetition_penalty instead.")


def _params(
    body: _Common,
    max_tokens: int,
    logprobs: int | None,
    tokenizer: Any,
    eos: int | None,
) -> tuple[SamplingParams, tuple[str, ...]]:
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    if stop and tokenizer is None:
        raise BadRequest(
            "stop strings need a tokenizer and this server has none; use stop_token_ids."
        )
    if any(not s for s in stop):
        raise BadRequest("a stop string must not be empty.")
    stop_ids = list(body.stop_token_ids or ())
    if eos is not None and not body.ignore_eos and eos not in stop_ids:
        stop_ids.append(eos)
    try:
        params = SamplingParams(
            temperature=body.temperature,
            top_k=0 if body.top_k == -1 else body.top_k,
            top_p=body.top_p,
            min_p=body.min_p,
            repetition_penalty=body.repetition_penalty,
            max_tokens=max_tokens,
            stop_token_ids=stop_ids,
            seed=body.seed,
            logprobs=logprobs,
        )
    except SamplingError as e:
        raise BadRequest(str(e)) from e
    return params, stop


def _check_ids(ids: list[int], i: int, max_model_len: int, vocab: int | None, many: bool) -> None:
    which = f"prompt {i}" if many else "the prompt"
    if not ids:
        raise BadRequest(f"{which} is empty; give at least one token.")
    if len(ids) >= max_model_len:
        raise BadRequest(
            f"{which} has {len(ids)} tokens, but this model takes at most {max_model_len} "
            f"tokens in all (max_model_len), so a prompt may have at most {max_model_len - 1}."
        )
    bad = next((t for t in ids if t < 0 or (vocab is not None and t >= vocab)), None)
    if bad is not None:
        size = f"of {vocab}" if vocab is not None else "(ids start at 0)"
        raise BadRequest(f"{which} holds token {bad}, outside the model's vocabulary {size}.")


def prepare_completion(
    body: CompletionRequest,
    tokenizer: Any,
    model_name: str,
    max_model_len: int,
    vocab: int | None,
    eos: int | None,
) -> Prepared:
    _common_checks(body, model_name)
    if body.echo:
        raise BadRequest("echo is not supported; the response holds the completion only.")
    if body.best_of not in (None, 1):
        raise BadRequest(f"best_of must be 1 (no server-side best-of), got {body.best_of}.")
    if body.suffix:
        raise BadRequest("suffix is not supported (no fill-in-the-middle).")
    p = body.prompt
    raw: list[str | list[int]]
    if isinstance(p, str) or (p and isinstance(p[0], int)):
        raw = [p]  # type: ignore[list-item]
    else:
        raw = list(p)  # type: ignore[arg-type]
    if not raw:
        raise BadRequest("prompt is an empty list; give a text or a list of token ids.")
    prompts: list[list[int]] = []
    for i, x in enumerate(raw):
        if isinstance(x, str):
            if tokenizer is None:
                raise BadRequest(
                    "this server has no tokenizer, so it takes token-id prompts only (a list "
                    "of integers), not text."
                )
            x = list(tokenizer(x)["input_ids"])
        _check_ids(list(x), i, max_model_len, vocab, len(raw) > 1)
        prompts.append([int(t) for t in x])
    max_tokens = body.max_tokens if body.max_tokens is not None else max_model_len
    params, stop = _params(body, max_tokens, body.logprobs, tokenizer, eos)
    return Prepared(
        prompts,
        params,
        stop,
        body.stream,
        bool(body.stream_options and body.stream_options.include_usage),
        body.logprobs is not None,
        body.return_token_ids or tokenizer is None,  # without text, the ids are the output
    )


def _message_text(m: dict[str, Any], i: int) -> dict[str, str]:
    role, content = m.get("role"), m.get("content")
    if not isinstance(role, str):
        raise BadRequest(f"message {i} has no role (system, user or assistant).")
    if isinstance(content, list):  # OpenAI's content parts: only text ones here
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise BadRequest(f"message {i} has a content part other than text.")
            parts.append(str(part.get("text", "")))
        content = "".join(parts)
    if not isinstance(content, str):
        raise BadRequest(f"message {i} has no text content.")
    return {"role": role, "content": content}


def prepare_chat(
    body: ChatRequest,
    tokenizer: Any,
    model_name: str,
    max_model_len: int,
    vocab: int | None,
    eos: int | None,
) -> Prepared:
    _common_checks(body, model_name)
    if tokenizer is None:
        raise BadRequest(
            "this server has no tokenizer, so it has no chat template; use /v1/completions "
            "with token-id prompts."
        )
    if getattr(tokenizer, "chat_template", None) is None:
        raise BadRequest(
            f"the model {model_name!r} has no chat template; use /v1/completions instead."
        )
    if not body.messages:
        raise BadRequest("messages is empty; give at least one message.")
    messages = [_message_text(m, i) for i, m in enumerate(body.messages)]
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as e:  # jinja's errors, a template raising on a role it refuses
        raise BadRequest(f"the chat template failed on these messages ({e}).") from e
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    _check_ids(ids, 0, max_model_len, vocab, False)
    max_tokens = body.max_completion_tokens or body.max_tokens or max_model_len
    top = (body.top_logprobs or 0) if body.logprobs else None
    params, stop = _params(body, max_tokens, top, tokenizer, eos)
    return Prepared(
        [ids],
        params,
        stop,
        body.stream,
        bool(body.stream_options and body.stream_options.include_usage),
        body.logprobs,
        body.return_token_ids,
    )


def token_text(token: int, tokenizer: Any) -> str:
    """A token as the logprobs name it: its text, or token_id:N without a tokenizer."""
    if tokenizer is None:
        return f"token_id:{token}"
    return str(tokenizer.decode([token]))


def choice_logprobs(lps: list[TokenLogprob], tokenizer: Any) -> dict[str, Any]:
    """/v1/completions' logprobs: tokens, token_logprobs, top_logprobs."""
    return {
        "tokens": [token_text(x.token, tokenizer) for x in lps],
        "token_logprobs": [x.logprob for x in lps],
        "top_logprobs": [{token_text(t, tokenizer): v for t, v in x.top} for x in lps],
    }


def chat_logprobs(lps: list[TokenLogprob], tokenizer: Any) -> dict[str, Any]:
    """/v1/chat/completions' logprobs: content, one entry per token with its top ones."""

    def entry(token: int, logprob: float) -> dict[str, Any]:
        s = token_text(token, tokenizer)
        return {"token": s, "logprob": logprob, "bytes": list(s.encode())}

    return {
        "content": [
            {**entry(x.token, x.logprob), "top_logprobs": [entry(t, v) for t, v in x.top]}
            for x in lps
        ]
    }
