"""The bodies of raywright's OpenAI-compatible HTTP API: strict pydantic models, so that a bad request is a 400
naming its field before any work is queued, and ``/openapi.json`` and ``/docs`` document every field."""

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag


class StrictBody(BaseModel):
    # Strict: "4" is not a number, NaN is not a float and unknown fields are errors, so typos never pass silently.
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(StrictBody):
    include_usage: bool = Field(False, description="Send the token usage in a last chunk with no choices.")


# An empty stop sequence would end every text before its first token (vLLM refuses one too).
StopText = Annotated[str, Field(min_length=1)]
Stop = Annotated[
    Annotated[StopText, Tag("text")] | Annotated[list[StopText], Field(max_length=4), Tag("texts")],
    Discriminator(lambda value: "texts" if isinstance(value, list) else "text"),  # an error is that form's
]
# Fields whose errors name the form they took (a tag the message implies): dropped from the error's field path.
TAGGED_FIELDS = ("prompt", "stop")


class SamplingFields(StrictBody):
    model: str | None = Field(None, description="The served model's id (GET /v1/models); any other is a 404.")
    max_tokens: int = Field(16, ge=1, description="Tokens to generate at most; prompt + max_tokens <= context.")
    temperature: float = Field(
        1.0, ge=0.0, le=2.0, description="0 (or below 0.001) is greedy decoding; higher is more random."
    )
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling; the most likely token always stays.")
    stop: Stop | None = Field(None, description="A sequence, or up to 4, that ends the text (not included).")
    seed: int | None = Field(None, ge=0, le=2**63 - 1, description="Makes sampling repeatable, alone or in a batch.")
    n: int = Field(1, ge=1, le=8, description="Completions per prompt (its choice i is seeded seed + i).")
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0, description="Subtracted once from generated tokens.")
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0, description="Subtracted per occurrence.")
    user: str | None = Field(None, max_length=256, description="The end user's id, for the server's logs.")
    stream: bool = Field(False, description="Server-sent events, one chunk per token, then [DONE].")
    stream_options: StreamOptions | None = None

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else self.stop or []


def _prompt_form(value: Any) -> str | None:
    """Which of OpenAI's prompt forms ``value`` takes (by its first item), so that an error is that form's."""
    if isinstance(value, str):
        return "text"
    if isinstance(value, list):
        return {int: "tokens", str: "texts", list: "token_lists"}.get(type(value[0]) if value else int)
    return None


MAX_PROMPTS = 32  # per request; each takes n of the replica's batch slots
Text = Annotated[str, Field(min_length=1)]
TokenIds = Annotated[list[int], Field(min_length=1)]
Prompt = Annotated[
    Annotated[Text, Tag("text")]
    | Annotated[TokenIds, Tag("tokens")]
    | Annotated[list[Text], Field(min_length=1, max_length=MAX_PROMPTS), Tag("texts")]
    | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_PROMPTS), Tag("token_lists")],
    Discriminator(
        _prompt_form,
        custom_error_type="prompt_form",
        custom_error_message="Input should be a string, a list of token ids, or a list of either",
    ),
]


class CompletionRequest(SamplingFields):
    prompt: Prompt = Field(
        description=f"The text to continue, or its token ids; or a batch of up to {MAX_PROMPTS} of either, whose "
        "choices come in order, n per prompt."
    )
    max_tokens: int = Field(
        16,
        ge=0,
        description="Tokens to generate at most; prompt + max_tokens <= context. 0 with echo scores the prompt.",
    )
    logprobs: int | None = Field(None, ge=0, le=5, description="Logprobs of each token and of the k most likely.")
    echo: bool = Field(False, description="Return the prompt before the completion (with logprobs, its logprobs).")

    def prompts(self) -> dict[str, str | list[int]]:
        """The request's prompts by the name an error gives each: its one prompt, or its batch's."""
        if isinstance(self.prompt, str) or isinstance(self.prompt[0], int):
            return {"prompt": self.prompt}
        return {f"prompt.{i}": prompt for i, prompt in enumerate(self.prompt)}


class ChatMessage(StrictBody):
    role: Literal["system", "user", "assistant"]
    content: str


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1, description="The conversation so far.")
    logprobs: bool = Field(False, description="Return the logprob of each generated token.")
    top_logprobs: int | None = Field(None, ge=0, le=5, description="With logprobs: the k most likely at each token.")


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(BaseModel):
    error: ErrorDetail
