"""Chat templating, tokenization and validation: everything the engine would reject, earlier.

A plain class (no Ray): the Serve deployment wraps ``preprocess_batch`` in ``@serve.batch`` so one
tokenizer call covers every request that arrived within the aggregation window. Chat templates
render in a bounded sandbox (``templates``), so one request's render cannot hold the window long.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

from serve_app.config import AppConfig
from serve_app.errors import APIError, ErrorInfo, context_length_exceeded
from serve_app.hops import PreprocessRequest, PreprocessResult, SamplingSpec, TokenizedPrompt
from serve_app.preprocess.block_hashes import block_hashes
from serve_app.preprocess.constraints import check_structured, check_tools
from serve_app.preprocess.templates import ChatTemplates

logger = logging.getLogger("serve_app.preprocess")

# A character bound checked before tokenizing: no tokenizer packs more than this many characters
# into one token on real text, so longer prompts can be rejected without tokenizing megabytes.
_MAX_CHARS_PER_TOKEN = 32


def derive_max_model_len(config: AppConfig, hf_config: Any) -> int:
    """The context window, checked against what the model supports without RoPE scaling."""
    native = int(getattr(hf_config, "max_position_embeddings", 0) or 0)
    requested = config.model.max_model_len
    scaling = config.model.rope_scaling or {}
    factor = float(scaling.get("factor", 1.0))
    original = int(scaling.get("original_max_position_embeddings", native) or native)
    supported = int(original * factor) if scaling else native
    if requested is None:
        return supported or 2048
    if supported and requested > supported:
        hint = (
            "raise rope_scaling.factor"
            if scaling
            else "set model.rope_scaling, e.g. {rope_type: yarn, factor: 4.0, "
            f"original_max_position_embeddings: {native}}}"
        )
        raise ValueError(
            f"model.max_model_len {requested} exceeds the model's {supported}; lower it or {hint}"
        )
    return requested


class Preprocessor:
    """Renders chat templates, tokenizes in batches, resolves and validates lengths."""

    def __init__(self, config: AppConfig, model_path: str) -> None:
        from transformers import AutoConfig, AutoTokenizer

        trust = config.model.trust_remote_code
        self.tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=trust)
        hf_config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust)
        self.max_model_len = derive_max_model_len(config, hf_config)
        self.vocab_size = max(len(self.tokenizer), int(getattr(hf_config, "vocab_size", 0)))
        # Block hashes only when the engine's request router reads them.
        routing = config.engine.routing
        self._hash_blocks = (
            (routing.block_size, routing.max_hashed_blocks) if routing.hashes_needed() else None
        )
        # The operator's template over the client's data: allow-listed kwargs, bounded render.
        self.templates = ChatTemplates(
            self.tokenizer,
            override=config.model.chat_template,
            allowed_kwargs=config.security.allowed_chat_template_kwargs,
            timeout_s=config.preprocessor.chat_template_timeout_s,
            max_chars=self.max_model_len * _MAX_CHARS_PER_TOKEN,  # More is rejected anyway.
        )

    def preprocess_batch(self, requests: list[PreprocessRequest]) -> list[PreprocessResult]:
        """One result per request, in order; a bad request never fails its neighbours."""
        # (request index, prompt index, text, add_special_tokens) of every text to tokenize.
        pending: list[tuple[int, int, str, bool]] = []
        prompts: list[list[TokenizedPrompt | None]] = []
        errors: list[ErrorInfo | None] = []
        for i, request in enumerate(requests):
            slots: list[TokenizedPrompt | None] = []
            try:
                for j, (text_or_ids, special) in enumerate(self._render(request)):
                    if isinstance(text_or_ids, str):
                        self._check_chars(request, text_or_ids)
                        pending.append((i, j, text_or_ids, special))
                        slots.append(None)
                    else:
                        slots.append(self._token_prompt(request, text_or_ids))
                errors.append(None)
            except APIError as exc:
                errors.append(exc.info)
            except Exception as exc:  # A bug met on one request's input: its 500, no others'.
                errors.append(_internal_error(request, exc))
            prompts.append(slots)
        try:
            self._tokenize_into(prompts, pending)
        except Exception:  # One text broke the batch call: tokenize each alone instead.
            for item in pending:
                try:
                    self._tokenize_into(prompts, [item])
                except Exception as exc:
                    errors[item[0]] = errors[item[0]] or _internal_error(requests[item[0]], exc)
        return [
            PreprocessResult(error=error)
            if error is not None
            else self._finish_or_fail(request, [p for p in slots if p is not None])
            for request, slots, error in zip(requests, prompts, errors, strict=True)
        ]

    def _finish_or_fail(
        self, request: PreprocessRequest, prompts: list[TokenizedPrompt]
    ) -> PreprocessResult:
        try:
            return self._finish(request, prompts)
        except APIError as exc:
            return PreprocessResult(error=exc.info)
        except Exception as exc:
            return PreprocessResult(error=_internal_error(request, exc))

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

    def _render(self, request: PreprocessRequest) -> list[tuple[str | list[int], bool]]:
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
        self, prompts: list[list[TokenizedPrompt | None]], pending: list[tuple[int, int, str, bool]]
    ) -> None:
        for special in (False, True):
            group = [item for item in pending if item[3] is special]
            if not group:
                continue
            encoded = self.tokenizer([text for _, _, text, _ in group], add_special_tokens=special)
            for (i, j, text, _), ids in zip(group, encoded["input_ids"], strict=True):
                prompts[i][j] = TokenizedPrompt(token_ids=list(ids), text=text)

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
            # vLLM keys cached blocks by adapter too: equal tokens under two adapters share none.
            salt = request.adapter.encode() if request.adapter else b""
            prompts = [
                replace(p, block_hashes=block_hashes(p.token_ids, size, most, salt))
                for p in prompts
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


def _prompt_param(request: PreprocessRequest) -> str:
    return "messages" if request.kind == "chat" else "prompt"


def _internal_error(request: PreprocessRequest, exc: Exception) -> ErrorInfo:
    logger.error("Preprocessing %s failed", request.request_id, exc_info=exc)
    return ErrorInfo(
        f"Internal error while preprocessing: {type(exc).__name__}",
        status=500,
        type="server_error",
        code="internal_error",
    )
