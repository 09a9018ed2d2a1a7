"""The OpenAI API's request bodies (the fields this server honours) and its error shape.

Types are strict, as OpenAI's own server is: ``"max_tokens": "10"`` is an error, not 10. Fields this server does
not know are ignored (SDKs send some by default), except those that would change the answer in a way it cannot
honour (``n`` > 1, log-probabilities, tools, penalties...): those are refused, so nobody gets a silently
different answer."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi.responses import JSONResponse
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    model_validator,
)

Number = StrictInt | StrictFloat

# Known OpenAI fields this server cannot honour, with the values that mean "not used".
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "n": (None, 1),
    "best_of": (None, 1),
    "logprobs": (None, False, 0),
    "top_logprobs": (None, 0),
    "echo": (None, False),
    "suffix": (None, ""),
    "logit_bias": (None, {}),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "tools": (None, []),
    "functions": (None, []),
    "response_format": (None, {"type": "text"}),
}


class APIError(Exception):
    """An error answered as OpenAI does: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class _Request(BaseModel):
    """What both endpoints take. ``max_tokens`` left out: the API's default (16 for a completion, the rest of
    the context for a chat)."""

    model_config = ConfigDict(extra="allow")

    model: StrictStr
    max_tokens: StrictInt | None = None
    temperature: Number | None = None  # the API's default is 1 (sampling); 0 is greedy
    top_p: Number | None = None
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    category: StrictStr | None = None  # extension: the task category a routed profile's rule reads

    @model_validator(mode="after")
    def _refuse_unsupported(self):
        for name, neutral in UNSUPPORTED.items():
            if (self.model_extra or {}).get(name) not in neutral:
                raise ValueError(
                    f"{name} is not supported by this server (one answer per request, text only)"
                )
        return self


class CompletionRequest(_Request):
    prompt: StrictStr | Annotated[list[StrictStr], Field(min_length=1, max_length=1)] | list[StrictInt]


class TextPart(BaseModel):
    type: Literal["text"]
    text: StrictStr


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: StrictStr
    content: StrictStr | list[TextPart] | None = None

    def as_template_input(self) -> dict:
        """The message as chat templates take it: content as one string."""
        content = (
            self.content if not isinstance(self.content, list) else "".join(p.text for p in self.content)
        )
        return {**(self.model_extra or {}), "role": self.role, "content": content or ""}


class ChatRequest(_Request):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: StrictInt | None = None  # the newer name of max_tokens
