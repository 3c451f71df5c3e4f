"""The admin routes' JSON bodies, validated by FastAPI; an invalid field is a 400 naming it in ``param``, worded by
``explained`` (see the RequestValidationError handler in ``app``)."""

from __future__ import annotations

import json
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    Field,
    StrictInt,
    ValidationError,
    ValidatorFunctionWrapHandler,
    WrapValidator,
    model_validator,
)
from pydantic_core import PydanticCustomError

Count = Annotated[StrictInt, Field(ge=0)]
MAX_PROBE_TOKENS = 4096


def explained(message: str) -> WrapValidator:
    """A field's validator that reports any invalid value with ``message``."""

    def validate(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        try:
            return handler(value)
        except ValidationError:
            raise PydanticCustomError("invalid_value", message) from None

    return WrapValidator(validate)


class JsonBody(BaseModel):
    @model_validator(mode="before")
    @classmethod
    def _from_bytes(cls, data: Any) -> Any:
        """FastAPI hands over the raw bytes of a body not sent as application/json (``curl -d``): read them as JSON."""
        return json.loads(data) if isinstance(data, bytes) else data


class Limits(JsonBody):
    """``{"max_calls": N}``: call N+1 gets a final 400, code call_limit (``null`` or absent: no limit)."""

    max_calls: Annotated[Count | None, explained("'max_calls' must be a non-negative integer or null")] = None


class Opening(Limits):
    """``{"max_calls": N, "seed": S}``: the call limit (``Limits``) and, with ``seed``, every call of the rollout
    sampled with a seed derived from S and the call's index: the same S gives the same samples from the same weights,
    and paired samples from two checkpoints (``null`` or absent: the agent's own seed, if any)."""

    seed: Annotated[Count | None, explained("'seed' must be a non-negative integer or null")] = None


class Reload(JsonBody):
    """``{"path": P}``: a folder of safetensors visible to vLLM."""

    path: Annotated[
        str, Field(min_length=1), explained("'path' (a folder of safetensors visible to vLLM) is required")
    ] = Field("", validate_default=True)


class Resume(JsonBody):
    """``{"version": N}``: the weights are now version N (absent: the version stays)."""

    version: Annotated[Count | None, explained("'version' must be a non-negative integer")] = None


class Probe(JsonBody):
    """``{"token_ids": [...]}``: the tokens to score (2 to ``MAX_PROBE_TOKENS``)."""

    token_ids: Annotated[
        list[Count],
        Field(min_length=2, max_length=MAX_PROBE_TOKENS),
        explained(f"'token_ids' must be a list of 2 to {MAX_PROBE_TOKENS} token ids (non-negative integers)"),
    ] = Field([], validate_default=True)
