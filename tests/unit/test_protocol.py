"""Protocol validation and the request → sampling conversion (no Ray, no engine)."""

from __future__ import annotations

import logging
import math

import pytest
from pydantic import ValidationError

from serve_app.errors import APIError
from serve_app.openai.protocol import ChatCompletionRequest, CompletionRequest, GenerationDefaults
from serve_app.openai.protocol.common import UnknownFieldLog

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def test_chat_defaults_follow_openai() -> None:
    spec = ChatCompletionRequest.model_validate(CHAT).to_sampling_spec(GenerationDefaults())
    assert (spec.temperature, spec.top_p, spec.n, spec.max_tokens) == (1.0, 1.0, 1, None)
    assert spec.logprobs is None and spec.stop == ()


def test_precedence_request_then_server_default_then_openai() -> None:
    defaults = GenerationDefaults(temperature=0.3, max_tokens=50)
    spec = ChatCompletionRequest.model_validate(CHAT).to_sampling_spec(defaults)
    assert spec.temperature == 0.3 and spec.max_tokens == 50 and spec.top_p == 1.0
    request = ChatCompletionRequest.model_validate({**CHAT, "temperature": 0, "max_tokens": 7})
    spec = request.to_sampling_spec(defaults)
    assert spec.temperature == 0 and spec.max_tokens == 7


@pytest.mark.parametrize(
    ("request_temperature", "server_default"), [(0, None), (None, 0.0), (1e-6, 0.7)]
)
def test_several_greedy_choices_are_a_400_on_n(
    request_temperature: float | None, server_default: float | None
) -> None:
    """vLLM refuses n > 1 at temperature 0 inside the engine: answer 400 before that, on n."""
    body = {**CHAT, "n": 2, "temperature": request_temperature}
    request = ChatCompletionRequest.model_validate(body)
    with pytest.raises(APIError) as caught:
        request.to_sampling_spec(GenerationDefaults(temperature=server_default))
    assert (caught.value.info.status, caught.value.info.param) == (400, "n")
    sampled = CompletionRequest.model_validate(
        {"model": "m", "prompt": "hi", "n": 2, "temperature": 0.7}
    )
    assert sampled.to_sampling_spec(GenerationDefaults()).n == 2


def test_max_completion_tokens_wins_over_deprecated_max_tokens() -> None:
    request = ChatCompletionRequest.model_validate(
        {**CHAT, "max_tokens": 9, "max_completion_tokens": 4}
    )
    assert request.to_sampling_spec(GenerationDefaults()).max_tokens == 4
    assert request.max_tokens_param == "max_completion_tokens"


def test_stop_string_and_list_and_logprobs() -> None:
    one = ChatCompletionRequest.model_validate({**CHAT, "stop": "x"})
    assert one.to_sampling_spec(GenerationDefaults()).stop == ("x",)
    many = ChatCompletionRequest.model_validate(
        {**CHAT, "stop": ["a", "b"], "logprobs": True, "top_logprobs": 3}
    )
    spec = many.to_sampling_spec(GenerationDefaults())
    assert spec.stop == ("a", "b") and spec.logprobs == 3


def test_logit_bias_keys_become_token_ids() -> None:
    request = ChatCompletionRequest.model_validate({**CHAT, "logit_bias": {"12": -100}})
    assert request.to_sampling_spec(GenerationDefaults()).logit_bias == {12: -100}
    with pytest.raises(ValidationError, match="token ids"):
        ChatCompletionRequest.model_validate({**CHAT, "logit_bias": {"abc": 1}})


@pytest.mark.parametrize(
    "patch",
    [
        {"temperature": -1},
        {"temperature": 2.5},
        {"top_p": 0},
        {"n": 0},
        {"max_tokens": 0},
        {"presence_penalty": 3},
        {"top_logprobs": 3},
        {"messages": []},
        {"messages": [{"role": "wizard", "content": "x"}]},
        {"messages": [{"role": "user"}]},
        {"messages": [{"role": "tool", "content": "x"}]},
        {"stream_options": {"include_usage": True}},
        {"temperature": math.nan},
    ],
)
def test_chat_rejects_bad_values(patch: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate({**CHAT, **patch})


def test_request_templates_are_refused() -> None:
    # Accepted (and ignored) before: the template is the operator's (model.chat_template).
    with pytest.raises(ValidationError, match=r"model\.chat_template"):
        ChatCompletionRequest.model_validate({**CHAT, "chat_template": "{{ 'x' * 10**9 }}"})


def test_unknown_fields_are_accepted_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    request = ChatCompletionRequest.model_validate({**CHAT, "brand_new_field": 1})
    assert request.model_extra == {"brand_new_field": 1}
    assert "brand_new_field" in caplog.text


def test_unknown_field_names_are_logged_in_bounded_memory(
    caplog: pytest.LogCaptureFixture,
) -> None:
    log = UnknownFieldLog(max_names=100, names_per_request=3)
    with caplog.at_level(logging.WARNING, logger="serve_app.protocol"):
        for round_ in range(20):
            log.record("ChatCompletionRequest", [f"f{round_}_{i}" for i in range(10_000)])
    assert len(log.names) == 100  # Not 200,000.
    assert log.unnamed == 200_000 - 100
    assert len(caplog.records) == 1  # Names until the cap, then a single note; no flood.
    assert "'f0_0', 'f0_1', 'f0_2' and 9997 more" in caplog.text
    assert "later ones are only counted" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="serve_app.protocol"):
        log.record("ChatCompletionRequest", ["f0_0"])  # Known: not logged again.
    assert not caplog.records


def test_content_parts_flatten_for_the_template() -> None:
    message = ChatCompletionRequest.model_validate(
        {
            **CHAT,
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                }
            ],
        }
    ).messages[0]
    assert message.to_template_dict() == {"role": "user", "content": "ab"}


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        ("hi", ["hi"]),
        (["a", "b"], ["a", "b"]),
        ([1, 2, 3], [[1, 2, 3]]),
        ([[1], [2, 3]], [[1], [2, 3]]),
    ],
)
def test_completion_prompt_shapes(prompt: object, expected: list[object]) -> None:
    request = CompletionRequest.model_validate({"model": "m", "prompt": prompt})
    assert request.prompt_list() == expected


def test_completion_defaults_to_16_tokens_like_openai() -> None:
    request = CompletionRequest.model_validate({"model": "m", "prompt": "x"})
    assert request.to_sampling_spec(GenerationDefaults()).max_tokens == 16


@pytest.mark.parametrize(
    "patch",
    [
        {"prompt": []},
        {"prompt": [-1]},
        {"logprobs": 21},
        {"best_of": 3},
        {"suffix": "x"},
        {"prompt": 5},
    ],
)
def test_completion_rejects_bad_values(patch: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate({"model": "m", "prompt": "x", **patch})


@pytest.mark.parametrize(
    ("patch", "param"),
    [
        ({"stream": "yes"}, "stream"),
        ({"stream": 1}, "stream"),
        ({"logprobs": "true"}, "logprobs"),
        ({"n": "2"}, "n"),
        ({"n": 2.0}, "n"),
        ({"n": True}, "n"),
        ({"max_tokens": "10"}, "max_tokens"),
        ({"temperature": "0.5"}, "temperature"),
        ({"temperature": False}, "temperature"),
        ({"seed": "42"}, "seed"),
        ({"priority": "5"}, "priority"),
        ({"logit_bias": {"1": "5"}}, "logit_bias.1"),
        ({"stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options"),
        ({"response_format": {"type": "json_schema", "json_schema": {"strict": "yes"}}},
         "response_format"),
        ({"tools": [{"type": "function", "function": {"name": "f", "strict": 1}}]}, "tools"),
    ],
)  # fmt: skip
def test_types_are_strict_like_openai(patch: dict[str, object], param: str) -> None:
    with pytest.raises(ValidationError) as error:
        ChatCompletionRequest.model_validate({**CHAT, **patch})
    locations = [".".join(str(part) for part in e["loc"]) for e in error.value.errors()]
    assert any(location.startswith(param) for location in locations), locations


def test_ints_are_still_valid_floats() -> None:
    request = ChatCompletionRequest.model_validate(
        {**CHAT, "temperature": 1, "top_p": 1, "presence_penalty": -2, "logit_bias": {"5": 10}}
    )
    spec = request.to_sampling_spec(GenerationDefaults())
    assert (spec.temperature, spec.top_p, spec.presence_penalty) == (1.0, 1.0, -2.0)
    assert spec.logit_bias == {5: 10.0}
