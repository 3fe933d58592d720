"""From a caller's prompt to a validated :class:`Request` (vLLM V1's ``InputProcessor``).

One place for what every front end does to a prompt before the engine sees it:

* **Prompt parsing** (:func:`parse_prompt`): vLLM's prompt forms, a string, a list of token ids,
  ``{"prompt": str}`` (TextPrompt) or ``{"prompt_token_ids": [...]}`` (TokensPrompt).
* **Encoding** (:func:`encode_prompt`): text with the tokenizer's special tokens (e.g. BOS),
  token ids as given.
* **Chat-template rendering** (:func:`render_chat_template`, :func:`chat_template_ids`): OpenAI
  tools and tool-call history written into the messages for templates that do not render tools
  themselves (:func:`kvserve.engine.chat_templates.prepare_messages`, Hermes convention), then the
  tokenizer's template with the assistant generation prompt; ids without added special tokens
  (the template writes its own). The offline ``LLM.chat``, the async engine (the replica's
  ``/v1/chat/completions``), ``/tokenize`` and the prefix-aware router's hasher all render
  through these two functions, so they agree token for token.
* **Request validation** (:meth:`InputProcessor.process_inputs`): sampling parameters against
  the model (vocabulary, EOS), LoRA against the engine's settings, and the prompt against
  ``max_model_len``.

The module holds no engine state: an :class:`InputProcessor` is built by ``LLMEngine`` from the
model's facts, and the async front keeps a copy with its own tokenizer
(:meth:`InputProcessor.with_tokenizer`; Hugging Face fast tokenizers are not safe to share
between threads).
"""

from __future__ import annotations

import copy
import json
import re
import threading

from kvserve.engine.chat_templates import prepare_messages
from kvserve.engine.request import Request
from kvserve.engine.sampling_params import SamplingParams


#: :meth:`InputProcessor.check_prompt_prefix`: a text longer than this many characters per token
#: of ``max_model_len`` has its prefix of that length counted first (English runs at about 4.5
#: characters per token in a BPE vocabulary, so a prompt that fits is almost never this long).
PREFIX_CHARS_PER_TOKEN = 8


class PromptTooLongError(ValueError):
    """The prompt leaves no room for an output token within ``max_model_len`` (or, when the
    caller names ``max_tokens``, the prompt plus ``max_tokens`` exceed it)."""


def parse_prompt(prompt: str | list[int] | dict) -> tuple[str | None, list[int] | None]:
    """vLLM's prompt forms: a string, a list of token ids, ``{"prompt": str}`` (TextPrompt) or
    ``{"prompt_token_ids": [...]}`` (TokensPrompt). Returns ``(text, token_ids)``, exactly one
    of them not None (the ids are a new list; they are not checked against a vocabulary here).

    Raises:
        ValueError: a dict with neither key, both, or any other key; a value of the wrong type;
            anything that is not a string, a list / tuple or a dict.
    """
    if isinstance(prompt, dict):
        prompt_cache_salt(prompt)  # validated here too: every path parses the prompt
        keys = set(prompt) - {"cache_salt"}
        unknown = keys - {"prompt", "prompt_token_ids"}
        if unknown or len(keys) != 1:
            raise ValueError(
                "a dict prompt takes exactly one of 'prompt' (text) or 'prompt_token_ids'"
                " (and optionally 'cache_salt')" + (f"; unknown key(s): {sorted(unknown)}" if unknown else "")
            )
        (key,) = keys
        value = prompt[key]
        if key == "prompt" and not isinstance(value, str):
            raise ValueError(f"prompt must be a string, got {type(value).__name__}")
        if key == "prompt_token_ids" and not isinstance(value, (list, tuple)):
            raise ValueError(f"prompt_token_ids must be a list of integers, got {type(value).__name__}")
        prompt = value
    if isinstance(prompt, str):
        return prompt, None
    if isinstance(prompt, (list, tuple)):
        return None, list(prompt)
    raise ValueError(f"a prompt is a string, a list of token ids or a dict, got {type(prompt).__name__}")


#: Longest ``cache_salt``, characters.
MAX_CACHE_SALT_CHARS = 1024


def prompt_cache_salt(prompt) -> str | None:
    """The ``cache_salt`` of a dict prompt (vLLM's ``TextPrompt`` / ``TokensPrompt`` key; None
    for other forms or without one): only requests with the same salt share prefix-cache blocks
    (it is part of the first block's hash).

    Raises:
        ValueError: a salt that is not a non-empty string of at most :data:`MAX_CACHE_SALT_CHARS`
            characters (the message names the field and the limit).
    """
    if not isinstance(prompt, dict) or prompt.get("cache_salt") is None:
        return None
    salt = prompt["cache_salt"]
    if not isinstance(salt, str) or not salt or len(salt) > MAX_CACHE_SALT_CHARS:
        raise ValueError(f"cache_salt must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} characters")
    return salt


_SURROGATE = re.compile("[\ud800-\udfff]")


def check_unicode(text: str, what: str = "prompt") -> str:
    """``text`` unchanged if it is valid Unicode; a lone UTF-16 surrogate (what a JSON
    ``"\\ud800"`` escape without its pair decodes to) is not, and no tokenizer encodes it.

    Raises:
        ValueError: ``text`` holds a surrogate code point (the message names ``what`` and where).
    """
    m = _SURROGATE.search(text)
    if m is not None:
        raise ValueError(
            f"{what} holds a lone surrogate (U+{ord(m.group()):04X} at character {m.start()}), "
            "which is not valid Unicode"
        )
    return text


def encode_prompt(tokenizer, prompt: str | list[int] | dict) -> list[int]:
    """Token ids of a prompt in any of :func:`parse_prompt`'s forms: text is encoded with the
    tokenizer's special tokens (e.g. BOS), token ids are returned as given (a new list).

    Raises:
        ValueError: see :func:`parse_prompt`; text with a lone surrogate (:func:`check_unicode`).
    """
    text, ids = parse_prompt(prompt)
    return tokenizer.encode(check_unicode(text), add_special_tokens=True) if text is not None else ids


def render_chat_template(
    tokenizer,
    messages: list[dict],
    tools: list[dict] | None = None,
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    template_kwargs: dict | None = None,
) -> str:
    """The text of a conversation (``[{"role", "content", ...}, ...]``, OpenAI's message dicts)
    under the tokenizer's chat template: tools and tool-call history first go through
    :func:`kvserve.engine.chat_templates.prepare_messages` (unchanged for a template that renders
    ``tools`` itself; written into the messages in the Hermes convention for one that does not;
    applying it twice changes nothing), then transformers' ``apply_chat_template(tools=...)``
    renders them, with the assistant generation prompt appended or, with
    ``continue_final_message``, the last message left open. ``template_kwargs``: more variables
    for the template (vLLM's ``chat_template_kwargs``, e.g. Qwen3's ``enable_thinking``); they
    cannot replace the ones set here.

    Raises:
        ValueError: the tokenizer has no chat template, the messages are malformed (the
            template or the tool rewriting rejects them), or both ``add_generation_prompt`` and
            ``continue_final_message`` are asked for.
    """
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise ValueError("this model's tokenizer has no chat template")
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
    try:
        messages, tools = prepare_messages(messages, tools, template)
        return tokenizer.apply_chat_template(
            messages,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            tools=tools or None,
            continue_final_message=continue_final_message,
            **(template_kwargs or {}),
        )
    except Exception as e:  # jinja errors on bad roles / content, a message without "role", ...
        raise ValueError(f"could not apply the chat template: {e}") from e


def chat_template_ids(
    tokenizer,
    messages: list[dict],
    add_generation_prompt: bool = True,
    tools: list[dict] | None = None,
    continue_final_message: bool = False,
    add_special_tokens: bool = False,
    template_kwargs: dict | None = None,
) -> list[int]:
    """Token ids of :func:`render_chat_template`'s text. ``tools``: OpenAI's ``{"type":
    "function", "function": {...}}`` list. ``add_special_tokens``: the tokenizer's own (e.g. BOS)
    on top of those the template writes (off by default, as vLLM's chat path).

    Raises:
        ValueError: see :func:`render_chat_template`; text with a lone surrogate (:func:`check_unicode`).
    """
    text = render_chat_template(
        tokenizer,
        messages,
        tools,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        template_kwargs=template_kwargs,
    )
    return tokenizer.encode(check_unicode(text, "messages"), add_special_tokens=add_special_tokens)


def max_token_bytes(tokenizer) -> int | None:
    """The most UTF-8 bytes of input text one token of ``tokenizer`` can stand for, or None
    where no such bound is sound.

    Sound for a byte-level BPE tokenizer (GPT-2's scheme: SmolLM2, Llama 3, Qwen) without a
    normalizer and with no added token that strips the whitespace beside it: every input byte
    then belongs to exactly one token, a regular token covers one byte per character of its
    vocabulary string and an added token its own text, so a text of ``B`` bytes has at least
    ``B / max_token_bytes`` tokens. A normalizer (NFKC, lowercasing, stripping) or a
    pre-tokenizer that drops characters can shrink the text before it is split, so such
    tokenizers get None (their prompts are only counted after tokenizing).
    """
    backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "_tokenizer", None)
    try:
        spec = json.loads(backend.to_str())
        vocab = backend.get_vocab(with_added_tokens=True)
    except Exception:  # a slow tokenizer, a mock: no bound
        return None
    pre = spec.get("pre_tokenizer") or {}
    parts = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    byte_level = any(p.get("type") == "ByteLevel" for p in parts) and all(
        p.get("type") == "ByteLevel" or (p.get("type") == "Split" and p.get("behavior") != "Removed") for p in parts
    )
    if (
        spec.get("normalizer") is not None
        or not byte_level
        or (spec.get("model") or {}).get("type") != "BPE"
        or any(a.get("lstrip") or a.get("rstrip") for a in spec.get("added_tokens", []))
    ):
        return None
    added = {a.get("content") for a in spec.get("added_tokens", [])}
    # a byte-level vocabulary string is one character per byte; an added token is its own text
    return max((len(t.encode("utf-8", "surrogatepass")) if t in added else len(t) for t in vocab), default=None) or None


class InputProcessor:
    """Turns a prompt and its parameters into a validated :class:`Request` (vLLM's
    ``InputProcessor.process_inputs``), and renders / encodes prompts for the front ends.

    Args:
        tokenizer: the model's Hugging Face tokenizer. Fast tokenizers are not safe to share
            between threads (a call that sets truncation or padding while another encodes fails
            with "Already borrowed"), so :attr:`tokenizer` is per thread: the first thread to
            use the processor gets this instance, every other thread its own copy (copied once
            per thread from a copy made here, which nothing ever encodes with), and a pool of
            threads (:class:`kvserve.engine.tokenizer_pool.TokenizerPool`) can tokenize at once.
        vocab_size: the model's vocabulary size (``hf_config.vocab_size``): token ids must be
            in ``[0, vocab_size)``.
        eos_token_ids: the ids that end generation (the request stops at them unless
            ``ignore_eos``).
        max_model_len: longest prompt + output of a request, tokens.
        enable_lora: requests may name a LoRA adapter.
    """

    def __init__(
        self, tokenizer, *, vocab_size: int, eos_token_ids: set[int], max_model_len: int, enable_lora: bool = False
    ):
        self.tokenizer = tokenizer
        self.vocab_size, self.eos_token_ids = vocab_size, eos_token_ids
        self.max_model_len, self.enable_lora = max_model_len, enable_lora

    @property
    def tokenizer(self):
        """This thread's tokenizer (see the class docstring)."""
        tok = getattr(self._local, "tokenizer", None)
        if tok is None:
            with self._lock:
                if not self._base_taken or self._template is None:  # no copy: one shared instance
                    self._base_taken, tok = True, self._base
                else:
                    tok = copy.deepcopy(self._template)
            self._local.tokenizer = tok
        return tok

    @tokenizer.setter
    def tokenizer(self, tokenizer) -> None:
        self._base, self._base_taken = tokenizer, False
        self._local, self._lock = threading.local(), threading.Lock()
        try:  # copied now, while no thread encodes with it (the copy is only ever copied)
            self._template = copy.deepcopy(tokenizer)
        except Exception:  # a tokenizer that cannot be copied: one shared instance, as before
            self._template = None
        #: bytes of text one token covers at most (None: no sound bound for this tokenizer)
        self.max_token_bytes = max_token_bytes(tokenizer)

    def __getstate__(self) -> dict:
        state = {k: v for k, v in self.__dict__.items() if k not in ("_local", "_lock", "_template", "_base_taken")}
        return state

    def __setstate__(self, state: dict) -> None:
        base = state.pop("_base")
        self.__dict__.update(state)
        self.tokenizer = base

    def with_tokenizer(self, tokenizer, *, keep_base: bool = False) -> "InputProcessor":
        """A copy of this processor that uses ``tokenizer`` (e.g. a second instance of the same
        tokenizer, for the async front); the model's facts are shared.

        Args:
            keep_base: ``tokenizer`` stays its owner's (the async front decodes with it on its
                event loop): no thread gets it from :attr:`tokenizer`, every thread that asks
                gets a copy of its own (where the tokenizer cannot be copied, one instance is
                shared, as without this flag).
        """
        other = copy.copy(self)
        other.tokenizer = tokenizer
        if keep_base:
            other.keep_base_tokenizer()
        return other

    def keep_base_tokenizer(self) -> None:
        """From now on no thread gets the tokenizer this processor was given from
        :attr:`tokenizer`: its owner keeps it (the async front decodes with it on its event
        loop) and every thread that asks gets a copy of its own. Where the tokenizer cannot be
        copied, the one instance stays shared."""
        if self._template is not None:
            self._base_taken = True

    # ---- prompts ---------------------------------------------------------------------------
    def check_prompt_bytes(self, text: str) -> None:
        """Before tokenizing: a text whose UTF-8 length alone shows it has more tokens than
        ``max_model_len`` allows (more than ``max_model_len * max_token_bytes`` bytes, see
        :func:`max_token_bytes`) is refused without being tokenized, so a prompt that cannot fit
        costs no tokenizer time. Nothing is refused where the tokenizer gives no sound bound.

        Raises:
            PromptTooLongError: the text cannot fit; the message gives the bytes and the bound.
        """
        per = self.max_token_bytes
        if per is None or len(text) * 4 <= per * self.max_model_len:  # cannot exceed: skip the count
            return
        n = len(text.encode("utf-8", "surrogatepass"))
        if n > per * self.max_model_len:
            raise PromptTooLongError(
                f"prompt is {n} bytes of text, so more than {self.max_model_len} tokens (each token of this model's "
                f"tokenizer covers at most {per} bytes); this model's context is {self.max_model_len} tokens "
                "(max_model_len)"
            )

    def check_prompt_prefix(self, text: str) -> None:
        """Before tokenizing a long text whole: where the text has more than
        :data:`PREFIX_CHARS_PER_TOKEN` characters per token of ``max_model_len``, its first
        ``PREFIX_CHARS_PER_TOKEN * max_model_len`` characters (cut before a space that follows
        a non-space) are tokenized first, and a text whose prefix alone has more than
        ``max_model_len`` tokens is refused: a prompt at the byte bound costs the tokenizer a
        prefix, not the whole text (tokenized whole, such prompts sent back to back take a core
        from the engine's other streams).

        Sound only where :func:`max_token_bytes` is (byte-level BPE with a GPT-2-style split,
        no normalizer): the pre-tokenizer's pieces never span a space that follows a
        non-space, and BPE merges stay inside a piece, so the prefix's pieces are the whole
        text's first pieces and its token count is at most the text's. Elsewhere nothing is
        checked here.

        Raises:
            PromptTooLongError: the prefix alone has more than ``max_model_len`` tokens.
        """
        limit = PREFIX_CHARS_PER_TOKEN * self.max_model_len
        if self.max_token_bytes is None or len(text) <= limit:
            return
        cut = text.rfind(" ", 0, limit + 1)
        while cut > 0 and text[cut - 1].isspace():
            cut = text.rfind(" ", 0, cut)
        if cut <= 0:  # no cut point: the text is tokenized whole (bounded by check_prompt_bytes)
            return
        n = len(self.tokenizer.encode(text[:cut], add_special_tokens=False))
        if n > self.max_model_len:
            raise PromptTooLongError(
                f"prompt is more than {self.max_model_len} tokens (its first {cut} characters alone are {n} tokens); "
                f"this model's context is {self.max_model_len} tokens (max_model_len)"
            )

    def check_prompt_length(self, text: str) -> None:
        """Before tokenizing: :meth:`check_prompt_bytes`, then :meth:`check_prompt_prefix`.

        Raises:
            PromptTooLongError: the text cannot fit, by its bytes or by its prefix's tokens.
        """
        self.check_prompt_bytes(text)
        self.check_prompt_prefix(text)

    def tokenize(self, prompt: str | list[int] | dict) -> list[int]:
        """Token ids of a prompt (:func:`encode_prompt`; not validated against the model, but text
        that cannot fit ``max_model_len`` is refused before it is tokenized,
        :meth:`check_prompt_bytes`).

        Raises:
            ValueError: a malformed prompt (:func:`parse_prompt`), text with a lone surrogate.
            PromptTooLongError: text too long to fit, by its bytes alone.
        """
        text, _ = parse_prompt(prompt)
        if text is not None:
            self.check_prompt_length(check_unicode(text))
        return encode_prompt(self.tokenizer, prompt)

    def render_chat_template(
        self,
        messages: list[dict],
        tools: list[dict] | None = None,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> str:
        """:func:`render_chat_template` with this processor's tokenizer.

        Raises:
            ValueError: no chat template, or malformed messages.
        """
        return render_chat_template(
            self.tokenizer,
            messages,
            tools,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
        )

    def chat_template_ids(
        self,
        messages: list[dict],
        tools: list[dict] | None = None,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        add_special_tokens: bool = False,
        template_kwargs: dict | None = None,
    ) -> list[int]:
        """:func:`chat_template_ids` with this processor's tokenizer; a rendered conversation
        that cannot fit by its bytes alone is refused before it is tokenized
        (:meth:`check_prompt_bytes`).

        Raises:
            ValueError: no chat template, malformed messages, a lone surrogate.
            PromptTooLongError: the conversation cannot fit, by its bytes alone.
        """
        tok = self.tokenizer
        text = render_chat_template(
            tok,
            messages,
            tools,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            template_kwargs=template_kwargs,
        )
        self.check_prompt_length(check_unicode(text, "messages"))
        return tok.encode(text, add_special_tokens=add_special_tokens)

    # ---- validation ------------------------------------------------------------------------
    def check_context_length(
        self, num_prompt_tokens: int, max_tokens: int | None = None, pooling: bool = False
    ) -> None:
        """A prompt of ``num_prompt_tokens`` tokens must leave room for one output token within
        ``max_model_len`` (a pooling request, which generates nothing, may fill it); with
        ``max_tokens``, the prompt plus ``max_tokens`` must fit too (the serving layer's rule:
        OpenAI's API refuses a request it cannot complete, where the engine alone would stop it
        at ``max_model_len`` with ``finish_reason "length"``).

        Raises:
            PromptTooLongError: the prompt (and ``max_tokens``) do not fit; the message gives
                the counts.
        """
        n, limit = num_prompt_tokens, self.max_model_len
        if n > limit or (n == limit and not pooling):
            raise PromptTooLongError(
                f"prompt is {n} tokens; this model's context is {limit} tokens "
                "(max_model_len), which must also leave room for at least one output token"
            )
        if max_tokens is not None and n + max_tokens > limit:
            raise PromptTooLongError(
                f"this model's maximum context length is {limit} tokens; the request asks for {n + max_tokens} "
                f"({n} in the prompt, {max_tokens} in max_tokens): shorten the prompt or lower max_tokens"
            )

    def _validate_params(self, params: SamplingParams | None, priority: int) -> SamplingParams:
        """The checks of ``params`` that need the model (besides :class:`SamplingParams`' own):
        ``stop_token_ids`` and ``logit_bias`` keys in the vocabulary, ``logprobs`` at most the
        vocabulary size, and with ``min_tokens`` a token left to sample once stop ids and EOS
        are forbidden. ``top_k`` above the vocabulary size is clamped by the sampler. Returns
        ``params`` (a default :class:`SamplingParams` for None).

        Raises:
            ValueError: see :meth:`process_inputs`.
        """
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        vocab = self.vocab_size
        if any(t >= vocab for t in params.stop_token_ids):
            raise ValueError(f"stop_token_ids must be token ids in [0, {vocab}), got {max(params.stop_token_ids)}")
        if params.logit_bias and max(params.logit_bias) >= vocab:
            raise ValueError(f"logit_bias keys must be token ids in [0, {vocab}), got {max(params.logit_bias)}")
        if params.logprobs is not None and params.logprobs > vocab:
            raise ValueError(f"logprobs must be at most the vocabulary size {vocab}, got {params.logprobs}")
        if (
            params.min_tokens
            and len(set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_token_ids)) >= vocab
        ):
            raise ValueError("stop_token_ids with min_tokens forbid every token of the vocabulary")
        return params

    def _validate_lora(self, lora_request) -> None:
        """A request may name an adapter only when LoRA is on (whether the adapter loads and
        fits is checked when the engine loads it).

        Raises:
            ValueError: ``lora_request`` with ``enable_lora`` off.
        """
        if lora_request is not None and not self.enable_lora:
            raise ValueError("this engine serves no LoRA adapters: start it with enable_lora=True")

    def _validate_model_inputs(self, ids: list[int], pooling: bool) -> None:
        """The prompt's token ids: not empty, integers in the vocabulary, within the context.

        Raises:
            ValueError, PromptTooLongError: see :meth:`process_inputs`.
        """
        if not ids:
            raise ValueError("prompt is empty")
        vocab = self.vocab_size
        if any((not isinstance(t, int)) or isinstance(t, bool) or t < 0 or t >= vocab for t in ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        self.check_context_length(len(ids), pooling=pooling)

    def process_inputs(
        self,
        request_id: str,
        prompt: str | list[int] | dict,
        params: SamplingParams | None = None,
        *,
        priority: int = 0,
        arrival_time: float | None = None,
        lora_request=None,
        pooling_params=None,
    ) -> Request:
        """Parse, tokenize and validate one request; returns the :class:`Request` (status
        ``WAITING``; its grammar is not compiled and its adapter not loaded: the engine does
        that, ``LLMEngine.make_request``). Touches no engine state, so it may run in any thread.

        ``pooling_params`` (:class:`kvserve.engine.pooling.PoolingParams`) makes an embedding request:
        ``params`` are ignored (``max_tokens=0``, no text), and the prompt may fill the whole
        context. ``arrival_time``: ``time.time()`` seconds (default now).

        Raises:
            ValueError: a malformed or empty prompt, text with a lone surrogate, token ids out of the vocabulary, a
                non-integer ``priority``, sampling parameters the model cannot honour (the
                message starts with the field name), or a LoRA adapter with LoRA off.
            PromptTooLongError: a prompt of ``max_model_len`` tokens or more (a
                ``ValueError``).
        """
        if pooling_params is not None:
            params = SamplingParams(max_tokens=0, detokenize=False)
        params = self._validate_params(params, priority)
        self._validate_lora(lora_request)
        text, ids = parse_prompt(prompt)
        if text is not None:
            self.check_prompt_length(check_unicode(text))
            ids = self.tokenizer.encode(text, add_special_tokens=True)
        self._validate_model_inputs(ids, pooling_params is not None)
        req = Request(
            request_id,
            ids,
            params,
            self.eos_token_ids,
            prompt=text,
            priority=priority,
            arrival_time=arrival_time,
            max_model_len=self.max_model_len,
        )
        req.pooling = pooling_params
        req.lora_request = lora_request
        req.cache_salt = prompt_cache_salt(prompt)
        return req
