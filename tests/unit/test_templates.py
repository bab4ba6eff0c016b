"""Chat templates in the bounded sandbox: Hugging Face's output, the kwargs allow-list, limits,
and the preprocessor rendering through it (chat and /tokenize alike)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from serve_app.app import check_chat_template
from serve_app.config import AppConfig, ModelConfig, SecurityConfig
from serve_app.errors import APIError
from serve_app.hops import PreprocessRequest, SamplingSpec
from serve_app.models import resolve_model
from serve_app.preprocess.preprocessor import Preprocessor
from serve_app.preprocess.templates import ChatTemplates

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather of a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
CHATS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "hi"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Hello!"},
    ],
    [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                }
            ],
        },
        {"role": "tool", "content": "sunny", "tool_call_id": "1"},
    ],
]
USER = CHATS[0]


@pytest.fixture(scope="module", params=["smollm2-135m-instruct", "tiny-qwen2"])
def tokenizer(request: pytest.FixtureRequest) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model(request.param))


def templates(tokenizer: Any, override: str | None = None, **limits: Any) -> ChatTemplates:
    options = {"timeout_s": 5.0, "max_chars": 100_000} | limits
    return ChatTemplates(
        tokenizer, override=override, allowed_kwargs=["enable_thinking"], **options
    )


def render(chat_templates: ChatTemplates, chat: list[dict[str, Any]], **options: Any) -> str:
    settings: dict[str, Any] = {
        "tools": None,
        "add_generation_prompt": True,
        "continue_final_message": False,
        "kwargs": {},
    }
    return chat_templates.render(chat, **(settings | options))


@pytest.mark.parametrize("chat", CHATS)
@pytest.mark.parametrize("tools", [None, TOOLS])
@pytest.mark.parametrize("mode", ["generation_prompt", "plain", "continue"])
def test_same_text_as_hugging_face(
    tokenizer: Any, chat: list[dict[str, Any]], tools: Any, mode: str
) -> None:
    options = {
        "add_generation_prompt": mode == "generation_prompt",
        "continue_final_message": mode == "continue",
    }
    expected = tokenizer.apply_chat_template(chat, tools=tools, tokenize=False, **options)
    assert render(templates(tokenizer), chat, tools=tools, **options) == expected


@pytest.mark.parametrize(
    "key", ["chat_template", "tokenize", "tools", "documents", "padding", "x" * 500]
)
def test_kwargs_outside_the_allow_list_are_a_400_naming_the_key(tokenizer: Any, key: str) -> None:
    with pytest.raises(APIError) as error:
        render(templates(tokenizer), USER, kwargs={key: "{{ 7 * 7 }}"})
    assert error.value.info.status == 400
    assert error.value.info.param == f"chat_template_kwargs.{key[:64]}"


def test_allowed_kwargs_reach_the_template(tokenizer: Any) -> None:
    override = "{% if enable_thinking %}THINK{% else %}QUIET{% endif %} {{ messages[0].content }}"
    chat_templates = templates(tokenizer, override)
    assert render(chat_templates, USER, kwargs={"enable_thinking": True}) == "THINK hi"
    assert render(chat_templates, USER) == "QUIET hi"


@pytest.mark.parametrize(
    "template",
    [
        "{{ 'x' * 10**9 }}",
        "{{ [1] * 10**9 }}",
        "{{ 'x'|center(10**9) }}",
        "{{ 'x'.ljust(10**9) }}",
        "{{ 10 ** 100000000 }}",
        "{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}"
        "{% endfor %}",
        "{% for i in range(99999) %}{% for j in range(99999) %}{{ j }}{% endfor %}{% endfor %}",
        "{% for m in messages %}{{ m.content * 1000000 }}{% endfor %}",
    ],
)
def test_output_is_capped_before_it_is_allocated(tokenizer: Any, template: str) -> None:
    with pytest.raises(APIError) as error:
        render(templates(tokenizer, template), USER)
    assert (error.value.info.param, error.value.info.code) == ("messages", "chat_template_limit")


def test_a_clients_large_number_is_not_mistaken_for_a_size(tokenizer: Any) -> None:
    args = "{% for k, v in messages[1].tool_calls[0].function.arguments.items() %}"
    override = args + "{{ k }}={{ v|string }} {{ v|tojson }}{% endfor %}"
    chat = [CHATS[2][0], {**CHATS[2][1], "tool_calls": [{"function": {"arguments": {"n": 10**9}}}]}]
    rendered = render(templates(tokenizer, override, max_chars=1000), chat)
    assert rendered == "n=1000000000 1000000000"


def test_a_render_that_runs_past_its_deadline_fails_alone(tokenizer: Any) -> None:
    spin = "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}x"
    with pytest.raises(APIError) as error:
        render(templates(tokenizer, spin, timeout_s=0.05), USER)
    assert "took longer than 0.05 s" in error.value.info.message
    # The same environment renders the next request normally.
    assert render(templates(tokenizer, "{{ messages[0].content }}"), USER) == "hi"


def test_template_errors_are_400s(tokenizer: Any) -> None:
    with pytest.raises(APIError) as error:
        render(templates(tokenizer, "{{ raise_exception('roles must alternate') }}"), USER)
    assert "roles must alternate" in error.value.info.message
    with pytest.raises(APIError):
        render(templates(tokenizer, "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}"), USER)


def test_chat_template_option_takes_text_or_a_file(tmp_path: Path) -> None:
    text = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    path = tmp_path / "template.jinja"
    path.write_text(text)
    assert ModelConfig(chat_template=text).chat_template == text
    assert ModelConfig(chat_template=str(path)).chat_template == text  # Replicas get the text.
    for bad in (str(tmp_path / "missing.jinja"), "plain words"):
        with pytest.raises(ValidationError, match="neither a Jinja template"):
            ModelConfig(chat_template=bad)
    check_chat_template(text)
    with pytest.raises(ValueError, match=r"model\.chat_template: line 1"):
        check_chat_template("{% for m in messages %}")


def test_template_parameters_cannot_be_allowed() -> None:
    assert SecurityConfig().allowed_chat_template_kwargs == ["enable_thinking"]
    with pytest.raises(ValidationError, match="chat_template, tokenize cannot be allowed"):
        SecurityConfig(allowed_chat_template_kwargs=["tokenize", "chat_template", "x"])
    config = AppConfig.model_validate(
        {"security": {"allowed_chat_template_kwargs": ["enable_thinking", "thinking"]}}
    )
    assert config.security.allowed_chat_template_kwargs == ["enable_thinking", "thinking"]
    for bad in (["bos_token"], ["not a name"], ["x" * 65], ["flag"] * 65):
        with pytest.raises(ValidationError, match="allowed_chat_template_kwargs"):
            SecurityConfig(allowed_chat_template_kwargs=bad)


@pytest.mark.parametrize("timeout_s", [0, -1, 61])
def test_render_deadline_is_bounded(timeout_s: float) -> None:
    with pytest.raises(ValidationError, match="chat_template_timeout_s"):
        AppConfig.model_validate({"preprocessor": {"chat_template_timeout_s": timeout_s}})


# --- Through the preprocessor: what the router's requests meet --------------------------------


def chat(kwargs: dict[str, Any] | None = None, **fields: Any) -> PreprocessRequest:
    return PreprocessRequest(
        "r", "chat", SamplingSpec(), messages=USER, chat_template_kwargs=kwargs or {}, **fields
    )


@pytest.fixture(scope="module")
def preprocessor() -> Preprocessor:
    return Preprocessor(AppConfig(), resolve_model("smollm2-135m-instruct"))


def test_preprocessor_tokens_match_hugging_face(preprocessor: Preprocessor) -> None:
    tokenizer = preprocessor.tokenizer
    for request in (chat(), chat({"enable_thinking": False}), chat(tools=TOOLS)):
        text = tokenizer.apply_chat_template(
            USER,
            tools=request.tools,
            add_generation_prompt=True,
            tokenize=False,
            **request.chat_template_kwargs,
        )
        expected = tokenizer(text, add_special_tokens=False)["input_ids"]
        [result] = preprocessor.preprocess_batch([request])
        assert result.error is None and result.prompts[0].token_ids == expected
        assert preprocessor.tokenize(request, None) == expected


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"chat_template": "{{ 7 * 7 }}"}, "chat_template_kwargs.chat_template"),  # Was run.
        ({"tokenize": True}, "chat_template_kwargs.tokenize"),  # Was a clash, param messages.
        ({"tools": TOOLS}, "chat_template_kwargs.tools"),
        ({"documents": [{"text": "x"}]}, "chat_template_kwargs.documents"),
        ({"bos_token": "{{ 7 * 7 }}"}, "chat_template_kwargs.bos_token"),
    ],
)
def test_preprocessor_refuses_kwargs_outside_the_allow_list(
    preprocessor: Preprocessor, kwargs: dict[str, Any], param: str
) -> None:
    neighbour = PreprocessRequest("n", "completion", SamplingSpec(), prompts=["hi"])
    bad, good = preprocessor.preprocess_batch([chat(kwargs), neighbour])
    assert bad.error is not None
    assert (bad.error.status, bad.error.param, bad.error.code) == (400, param, "invalid_value")
    assert good.error is None and good.prompts
    with pytest.raises(APIError) as error:  # /tokenize renders the same way.
        preprocessor.tokenize(chat(kwargs), None)
    assert error.value.info.param == param


def test_operator_template_and_deadline_come_from_the_config() -> None:
    spin = "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}x"
    config = AppConfig.model_validate(
        {"model": {"chat_template": spin}, "preprocessor": {"chat_template_timeout_s": 0.05}}
    )
    slow = Preprocessor(config, resolve_model("smollm2-135m-instruct"))
    neighbour = PreprocessRequest("n", "completion", SamplingSpec(), prompts=["hi"])
    bad, good = slow.preprocess_batch([chat(), neighbour])
    assert bad.error is not None and bad.error.code == "chat_template_limit"
    assert "took longer than 0.05 s" in bad.error.message
    assert good.error is None and good.prompts
