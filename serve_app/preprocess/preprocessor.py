"""Chat templating, tokenization and validation: everything the engine would reject, earlier.

A plain class (no Ray): the Serve deployment renders each request on its own (``render``: chat
template, structured-output checks; bounded, so one slow request holds up nobody else), then calls
``preprocess_many`` once per aggregation window (``@serve.batch``), so one tokenizer call covers
every request that arrived within it.
"""

from __future__ import annotations

import logging
from dataclasses import replace

from serve_app.config import AppConfig
from serve_app.errors import (
    APIError,
    ErrorInfo,
    context_length_exceeded,
    inject_fault,
    internal_error,
)
from serve_app.hops import PreprocessRequest, PreprocessResult, SamplingSpec, TokenizedPrompt
from serve_app.preprocess.block_hashes import block_hashes
from serve_app.preprocess.compile_check import check_structured, check_tools
from serve_app.preprocess.templates import ChatTemplates

logger = logging.getLogger("serve_app.preprocess")

# A character bound checked before tokenizing: no tokenizer packs more than this many characters
# into one token on real text, so longer prompts can be rejected without tokenizing megabytes.
_MAX_CHARS_PER_TOKEN = 32

# A request rendered: each prompt's text (or token ids) and whether to add special tokens.
Rendered = list[tuple[str | list[int], bool]]


class Preprocessor:
    """Renders chat templates, tokenizes in batches, resolves and validates lengths."""

    def __init__(self, config: AppConfig, model_path: str) -> None:
        from transformers import AutoConfig, AutoTokenizer

        trust = config.model.trust_remote_code
        self.tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=trust)
        hf_config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust)
        native = int(getattr(hf_config, "max_position_embeddings", 0) or 0)
        self.max_model_len = config.model.context_window(native)
        self.vocab_size = max(len(self.tokenizer), int(getattr(hf_config, "vocab_size", 0)))
        # Block hashes only when the engine's request router reads them.
        routing = config.engine.routing
        self._hash_blocks = (
            (routing.block_size, routing.max_hashed_blocks) if routing.hashes_needed() else None
        )
        self._fault_injection = config.fault_injection
        self.templates = ChatTemplates(
            self.tokenizer,
            override=config.model.chat_template,
            allowed_kwargs=config.security.allowed_chat_template_kwargs,
            timeout_s=config.preprocessor.chat_template_timeout_s,
            max_chars=self.max_model_len * _MAX_CHARS_PER_TOKEN,  # More is rejected anyway.
        )

    def render(self, request: PreprocessRequest) -> Rendered | ErrorInfo:
        """Template and checks of one request, before it joins a window; errors as values
        (a bug this request triggers included: a 500 for it alone)."""
        try:
            return self._render(request)
        except APIError as exc:
            return exc.info
        except Exception as exc:
            return _bug(request, exc)

    def preprocess_many(
        self,
        requests: list[PreprocessRequest],
        rendered: list[Rendered | ErrorInfo] | None = None,
    ) -> list[PreprocessResult]:
        """One result per request, in order; a bad request — or a bug one request triggers —
        never fails its neighbours in the window. ``rendered``: what ``render`` returned for
        each, if already done."""
        # (request index, prompt index, text, add_special_tokens) of every text to tokenize.
        pending: list[tuple[int, int, str, bool]] = []
        prompts: list[list[TokenizedPrompt | None]] = []
        errors: list[ErrorInfo | None] = []
        for i, request in enumerate(requests):
            slots: list[TokenizedPrompt | None] = []
            done = rendered[i] if rendered is not None else self.render(request)
            try:
                if isinstance(done, ErrorInfo):
                    raise APIError.from_info(done)
                for j, (text_or_ids, special) in enumerate(done):
                    if isinstance(text_or_ids, str):
                        self._check_chars(request, text_or_ids)
                        pending.append((i, j, text_or_ids, special))
                        slots.append(None)
                    else:
                        slots.append(self._token_prompt(request, text_or_ids))
                errors.append(None)
            except APIError as exc:
                errors.append(exc.info)
            except Exception as exc:
                errors.append(_bug(request, exc))
            prompts.append(slots)
        self._tokenize_into(prompts, pending, errors)
        return [
            PreprocessResult(error=error)
            if error is not None
            else self._finish_one(request, [p for p in slots if p is not None])
            for request, slots, error in zip(requests, prompts, errors, strict=True)
        ]

    def _finish_one(
        self, request: PreprocessRequest, prompts: list[TokenizedPrompt]
    ) -> PreprocessResult:
        try:
            return self._finish(request, prompts)
        except Exception as exc:
            return PreprocessResult(error=_bug(request, exc))

    def tokenize(self, request: PreprocessRequest, add_special_tokens: bool | None) -> list[int]:
        """Token ids exactly as a generation request would get them, without length checks."""
        [(text_or_ids, special)] = self._render(request)
        if not isinstance(text_or_ids, str):
            return list(self._token_prompt(request, text_or_ids).token_ids)
        self._check_chars(request, text_or_ids)
        special = special if add_special_tokens is None else add_special_tokens
        return list(self.tokenizer(text_or_ids, add_special_tokens=special)["input_ids"])

    def detokenize(self, token_ids: list[int]) -> tuple[str, list[str]]:
        self._check_token_ids(token_ids, "tokens")
        return (
            str(self.tokenizer.decode(token_ids)),
            list(self.tokenizer.convert_ids_to_tokens(token_ids)),
        )

    def _render(self, request: PreprocessRequest) -> Rendered:
        inject_fault(self._fault_injection, request.sampling.stop, "preprocess")
        if request.sampling.structured is not None:
            check_structured(request.sampling.structured)
        check_tools(request.tools)
        if request.kind == "completion":
            return [(prompt, True) for prompt in request.prompts or []]
        text = self.templates.render(
            request.messages or [],
            tools=request.tools,
            add_generation_prompt=request.add_generation_prompt,
            continue_final_message=request.continue_final_message,
            kwargs=request.chat_template_kwargs,
        )
        return [(text, False)]

    def _check_chars(self, request: PreprocessRequest, text: str) -> None:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:  # Lone surrogates would fail the whole batch call.
            raise APIError(
                f"The text is not valid Unicode ({exc.reason} at position {exc.start}).",
                param=_prompt_param(request),
            ) from exc
        if len(text) > self.max_model_len * _MAX_CHARS_PER_TOKEN:
            raise context_length_exceeded(
                prompt_tokens=len(text) // _MAX_CHARS_PER_TOKEN,
                max_tokens=None,
                max_model_len=self.max_model_len,
                param=_prompt_param(request),
            )

    def _check_sampling(self, request: PreprocessRequest) -> ErrorInfo | None:
        return _sampling_errors(request.sampling, self.vocab_size)

    def _check_token_ids(self, ids: list[int], param: str) -> None:
        bad = next((t for t in ids if t >= self.vocab_size), None)
        if bad is not None:
            raise APIError(
                f"Token id {bad} is out of range; this model's vocabulary has "
                f"{self.vocab_size} tokens.",
                param=param,
            )

    def _token_prompt(self, request: PreprocessRequest, ids: list[int]) -> TokenizedPrompt:
        self._check_token_ids(ids, "prompt")
        text = str(self.tokenizer.decode(ids)) if request.echo else None
        return TokenizedPrompt(token_ids=list(ids), text=text)

    def _tokenize_into(
        self,
        prompts: list[list[TokenizedPrompt | None]],
        pending: list[tuple[int, int, str, bool]],
        errors: list[ErrorInfo | None],
    ) -> None:
        for special in (False, True):
            group = [item for item in pending if item[3] is special]
            if not group:
                continue
            try:
                texts = [text for _, _, text, _ in group]
                encoded = self.tokenizer(texts, add_special_tokens=special)["input_ids"]
            except Exception:  # One text broke the batch call: find it, keep the others.
                encoded = [self._encode_one(item, errors) for item in group]
            for (i, j, text, _), ids in zip(group, encoded, strict=True):
                if ids is not None:
                    prompts[i][j] = TokenizedPrompt(token_ids=list(ids), text=text)

    def _encode_one(
        self, item: tuple[int, int, str, bool], errors: list[ErrorInfo | None]
    ) -> list[int] | None:
        i, _, text, special = item
        try:
            return list(self.tokenizer(text, add_special_tokens=special)["input_ids"])
        except Exception as exc:
            errors[i] = errors[i] or _bug(None, exc)
            return None

    def _finish(
        self, request: PreprocessRequest, prompts: list[TokenizedPrompt]
    ) -> PreprocessResult:
        sampling = request.sampling
        longest = max(len(p.token_ids) for p in prompts)
        param = _prompt_param(request)
        if min(len(p.token_ids) for p in prompts) == 0:
            return PreprocessResult(error=ErrorInfo("A prompt is empty.", param=param))
        if error := self._check_sampling(request):
            return PreprocessResult(error=error)
        requested = sampling.max_tokens
        if longest >= self.max_model_len or (
            requested is not None and longest + requested > self.max_model_len
        ):
            err = context_length_exceeded(
                prompt_tokens=longest,
                max_tokens=requested,
                max_model_len=self.max_model_len,
                param=param if longest >= self.max_model_len else request.max_tokens_param,
            )
            return PreprocessResult(error=err.info)
        max_tokens = requested if requested is not None else self.max_model_len - longest
        if self._hash_blocks is not None:
            size, most = self._hash_blocks
            prompts = [
                replace(p, block_hashes=block_hashes(p.token_ids, size, most)) for p in prompts
            ]
        return PreprocessResult(prompts=prompts, sampling=sampling.with_max_tokens(max_tokens))


def _sampling_errors(sampling: SamplingSpec, vocab_size: int) -> ErrorInfo | None:
    """What vLLM would reject about token ids and lengths, said as a 400 before engine time."""
    bad_stop = [t for t in sampling.stop_token_ids if t >= vocab_size]
    if bad_stop:
        return ErrorInfo(
            f"stop_token_ids {bad_stop} are outside the vocabulary ({vocab_size}).",
            param="stop_token_ids",
        )
    bad_bias = [t for t in sampling.logit_bias or {} if t >= vocab_size]
    if bad_bias:
        return ErrorInfo(
            f"logit_bias token ids {bad_bias} are outside the vocabulary ({vocab_size}).",
            param="logit_bias",
        )
    if sampling.max_tokens is not None and sampling.min_tokens > sampling.max_tokens:
        return ErrorInfo(
            f"min_tokens {sampling.min_tokens} exceeds max_tokens {sampling.max_tokens}.",
            param="min_tokens",
        )
    return None


def _bug(request: PreprocessRequest | None, exc: Exception) -> ErrorInfo:
    """A bug one request triggered: logged with its traceback, a 500 for that request only."""
    logger.error(
        "Preprocessing %s failed", request.request_id if request else "a prompt", exc_info=exc
    )
    return internal_error(exc)


def _prompt_param(request: PreprocessRequest) -> str:
    return "messages" if request.kind == "chat" else "prompt"
