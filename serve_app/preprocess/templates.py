"""Chat templates in a bounded sandbox: the operator's template over a client's data.

A request chooses only allow-listed flags (``chat_template_kwargs``, e.g. ``enable_thinking``);
the template is the checkpoint's or ``model.chat_template``. Rendering matches Hugging Face's
``apply_chat_template`` (same sandbox, filters and globals), with limits checked inside the
template: every call, attribute, item, filter, ``+``/``*``/``**`` and output chunk checks the
request's deadline and output cap. A template that loops or balloons on a client's data fails
that request with a 400 instead of holding the preprocessor.
"""

from __future__ import annotations

import functools
import json
import threading
import time
from collections.abc import Callable, Iterable
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from serve_app.errors import APIError

_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "  # Hugging Face's marker, for identical output.
_MAX_KEY_IN_ERRORS = 64


class RenderLimitExceeded(jinja2.exceptions.SecurityError):
    """The render ran past its deadline or output cap."""


class _Budget(threading.local):
    """The render in progress on this thread (renders run on several threads at once)."""

    deadline = float("inf")
    timeout_s = 0.0
    max_chars = 0

    def check(self) -> None:
        if time.monotonic() > self.deadline:
            raise RenderLimitExceeded(f"took longer than {self.timeout_s:g} s")

    def check_size(self, size: int) -> None:
        if size > self.max_chars:
            raise RenderLimitExceeded(f"produced more than {self.max_chars} characters")


class _Generation(jinja2.ext.Extension):
    """``{% generation %}…{% endgeneration %}`` (assistant-mask templates) renders its body."""

    tags = {"generation"}  # noqa: RUF012 (jinja2 declares it a set)

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


class BoundedSandbox(ImmutableSandboxedEnvironment):
    # Intercepted, so they run through call_binop (and are never constant-folded at compile).
    intercepted_binops = frozenset({"*", "**", "+"})

    def __init__(self, budget: _Budget) -> None:
        super().__init__(
            trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols]
        )
        self.budget = budget
        self.filters["tojson"] = _tojson
        self.filters = {name: self._guarded(f) for name, f in self.filters.items()}
        self.globals["raise_exception"] = _raise_exception
        self.globals["strftime_now"] = _strftime_now

    def _guarded(self, function: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(function)  # Keeps jinja's pass_context/pass_environment markers.
        def guarded(*args: Any, **kwargs: Any) -> Any:
            self._check_args(args, kwargs)
            result = function(*args, **kwargs)
            if isinstance(result, str | list):
                self.budget.check_size(len(result))
            return result

        return guarded

    def _check_args(
        self, args: Iterable[Any], kwargs: dict[str, Any], receiver: Any = None
    ) -> None:
        """Sizes come in as ints next to what they size ('x'|center(10**9), 'x'.ljust(…)):
        refuse them before the allocation, not after. A lone int (a client's number through
        ``|string`` or ``|tojson``) sizes nothing."""
        self.budget.check()
        values = (*args, *kwargs.values())
        if not any(isinstance(v, str | list | tuple) for v in (*values, receiver)):
            return
        for value in values:
            if type(value) is int and value > self.budget.max_chars:
                self.budget.check_size(value)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        __self._check_args(args, kwargs, getattr(__obj, "__self__", None))
        return super().call(__context, __obj, *args, **kwargs)

    def getattr(self, obj: Any, attribute: str) -> Any:
        return self._sized(super().getattr(obj, attribute))

    def getitem(self, obj: Any, argument: Any) -> Any:
        return self._sized(super().getitem(obj, argument))

    def _sized(self, value: Any) -> Any:
        """Values read back (a namespace's string doubled with ``~`` in a loop) stay in bounds."""
        self.budget.check()
        if isinstance(value, str | list):
            self.budget.check_size(len(value))
        return value

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        self.budget.check()
        if operator == "*":
            for seq, times in ((left, right), (right, left)):
                if isinstance(seq, str | list | tuple) and isinstance(times, int):
                    self.budget.check_size(len(seq) * times)
        elif operator == "+" and isinstance(left, str | list) and isinstance(right, str | list):
            self.budget.check_size(len(left) + len(right))
        elif operator == "**" and isinstance(right, int) and right > 64 and left not in (0, 1, -1):
            raise RenderLimitExceeded(f"computed a power with exponent {right}")
        return super().call_binop(context, operator, left, right)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    # Hugging Face's: Jinja's own tojson escapes HTML characters.
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def compile_template(text: str) -> jinja2.Template:
    """Compile ``text`` in the bounded sandbox; raises jinja2's TemplateSyntaxError."""
    return BoundedSandbox(_Budget()).from_string(text)


def check_template_kwargs(kwargs: dict[str, Any], allowed: Iterable[str]) -> None:
    """Only the operator's allow-list: anything else (chat_template, tokenize, …) is a 400."""
    allowed = set(allowed)
    for key in kwargs:
        if key not in allowed:
            shown = key[:_MAX_KEY_IN_ERRORS]
            listed = ", ".join(sorted(allowed)) or "none"
            raise APIError(
                f"chat_template_kwargs.{shown} is not accepted by this server (allowed keys: "
                f"{listed}); templates and their parameters are the server's.",
                param=f"chat_template_kwargs.{shown}",
                code="invalid_value",
            )


class ChatTemplates:
    """Renders chats with the tokenizer's template(s) or an operator's override, bounded."""

    def __init__(
        self,
        tokenizer: Any,
        *,
        override: str | None,
        allowed_kwargs: Iterable[str],
        timeout_s: float,
        max_chars: int,
    ) -> None:
        self._tokenizer = tokenizer
        self._override = override
        self._allowed = frozenset(allowed_kwargs)
        self._timeout_s, self._max_chars = timeout_s, max_chars
        self._budget = _Budget()
        self._env = BoundedSandbox(self._budget)
        self._compiled: dict[str, jinja2.Template] = {}
        self._lock = threading.Lock()
        if override is not None:
            self._template(override)  # A broken override fails the replica at start.

    def _template(self, text: str) -> jinja2.Template:
        with self._lock:
            if text not in self._compiled:
                self._compiled[text] = self._env.from_string(text)
            return self._compiled[text]

    def render(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None,
        add_generation_prompt: bool,
        continue_final_message: bool,
        kwargs: dict[str, Any],
    ) -> str:
        """The prompt text; APIError (400) for disallowed kwargs or a failed/limited render."""
        check_template_kwargs(kwargs, self._allowed)
        try:
            text = self._tokenizer.get_chat_template(self._override, tools)
            template = self._template(text)
            chat = [dict(message) for message in messages]
            final = str(chat[-1].get("content") or "") if chat else ""
            if continue_final_message and chat:
                chat[-1]["content"] = final + _CONTINUE_TAG
            context = {
                **self._tokenizer.special_tokens_map,
                **kwargs,
                "messages": chat,
                "tools": tools,
                "documents": None,
                "add_generation_prompt": add_generation_prompt,
            }
            rendered = self._bounded(template, context)
        except RenderLimitExceeded as exc:
            raise APIError(
                f"The chat template {exc} on this request; shorten the conversation.",
                param="messages",
                code="chat_template_limit",
            ) from None
        except Exception as exc:  # jinja2's TemplateError and friends for bad chats.
            raise APIError(f"Could not apply the chat template: {exc}", param="messages") from exc
        return _cut_at_final(rendered, final) if continue_final_message else rendered

    def _bounded(self, template: jinja2.Template, context: dict[str, Any]) -> str:
        budget = self._budget
        budget.timeout_s, budget.max_chars = self._timeout_s, self._max_chars
        budget.deadline = time.monotonic() + self._timeout_s
        try:
            parts: list[str] = []
            size = 0
            for part in template.generate(**context):
                size += len(part)
                budget.check_size(size)
                budget.check()
                parts.append(part)
            return "".join(parts)
        finally:
            budget.deadline = float("inf")


def _cut_at_final(rendered: str, final: str) -> str:
    """continue_final_message: end the prompt right after the final message, as Hugging Face
    does (the marker shows where it ended, even when the template adds an end-of-turn)."""
    marker = _CONTINUE_TAG.strip()
    if final.strip() not in rendered or marker not in rendered:
        raise APIError(
            "continue_final_message is set but the chat template drops the final message.",
            param="continue_final_message",
        )
    at = rendered.rindex(marker)
    if rendered[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return rendered[:at]
    return rendered[:at].rstrip()
