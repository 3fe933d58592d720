"""kvserve/engine/input_processor.py: prompt forms, chat-template rendering and request validation in one
place; the engine, the async front and the old engine-level names all go through it.

References: the tokenizer's own ``apply_chat_template`` / ``encode`` (transformers), and
:func:`kvserve.engine.chat_templates.prepare_messages` for the tool rewriting of a template without tools.
"""

import asyncio

import pytest

from kvserve.engine.chat_templates import prepare_messages
from kvserve.engine.input_processor import (
    InputProcessor,
    PromptTooLongError,
    chat_template_ids,
    encode_prompt,
    parse_prompt,
    render_chat_template,
)
from kvserve.engine.model_loader import load_tokenizer
from kvserve.engine.sampling_params import SamplingParams

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
MESSAGES = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "21 C, sunny"},
]


@pytest.fixture(scope="module")
def tok(tiny_llama_path):
    return load_tokenizer(tiny_llama_path)  # SmolLM2's tokenizer and chat template (no tools in it)


def processor(tok, max_model_len=32, enable_lora=False):
    return InputProcessor(
        tok, vocab_size=len(tok), eos_token_ids={tok.eos_token_id}, max_model_len=max_model_len, enable_lora=enable_lora
    )


def test_prompt_forms(tok):
    assert parse_prompt("hi") == ("hi", None)
    assert parse_prompt([3, 4]) == (None, [3, 4]) and parse_prompt((3, 4)) == (None, [3, 4])
    assert parse_prompt({"prompt": "hi"}) == ("hi", None)
    assert parse_prompt({"prompt_token_ids": [5]}) == (None, [5])
    for bad, match in (
        ({"prompt": "a", "prompt_token_ids": [1]}, "exactly one"),
        ({"text": "a"}, "unknown key"),
        ({"prompt": 3}, "must be a string"),
        ({"prompt_token_ids": "12"}, "list of integers"),
        (3.5, "a prompt is"),
    ):
        with pytest.raises(ValueError, match=match):
            parse_prompt(bad)
    assert encode_prompt(tok, "The sky") == tok.encode("The sky", add_special_tokens=True)
    assert encode_prompt(tok, {"prompt": "The sky"}) == tok.encode("The sky", add_special_tokens=True)
    assert encode_prompt(tok, {"prompt_token_ids": [9, 8]}) == [9, 8]


def test_chat_template_equals_the_tokenizers(tok):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital of France?"}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert render_chat_template(tok, msgs) == text
    assert chat_template_ids(tok, msgs) == tok.encode(text, add_special_tokens=False)
    assert chat_template_ids(tok, msgs, add_special_tokens=True) == tok.encode(text, add_special_tokens=True)
    open_text = tok.apply_chat_template(
        msgs + [{"role": "assistant", "content": "It is"}],
        tokenize=False,
        add_generation_prompt=False,
        continue_final_message=True,
    )
    assert chat_template_ids(
        tok,
        msgs + [{"role": "assistant", "content": "It is"}],
        add_generation_prompt=False,
        continue_final_message=True,
    ) == tok.encode(open_text, add_special_tokens=False)
    with pytest.raises(ValueError, match="cannot both be true"):
        chat_template_ids(tok, msgs, continue_final_message=True)
    with pytest.raises(ValueError, match="could not apply the chat template"):
        chat_template_ids(tok, [{"content": "no role"}])


def test_tools_are_written_for_a_template_without_them(tok):
    """The one rendering path writes tools and tool calls (Hermes) for a template that does not
    render them, exactly as prepare_messages + the template; rendering prepared messages again
    changes nothing (the serving layer used to prepare them itself first)."""
    prepared, tools = prepare_messages(MESSAGES, [WEATHER], tok.chat_template)
    assert tools is None
    want = tok.apply_chat_template(prepared, tokenize=False, add_generation_prompt=True)
    got = render_chat_template(tok, MESSAGES, [WEATHER])
    assert got == want and "<tools>" in got and "<tool_response>\n21 C, sunny\n</tool_response>" in got
    assert render_chat_template(tok, prepared, tools) == got
    assert chat_template_ids(tok, MESSAGES, True, [WEATHER]) == tok.encode(want, add_special_tokens=False)


def test_process_inputs_validates_against_the_model(tok):
    p = processor(tok, max_model_len=8)
    ids = tok.encode("a b c", add_special_tokens=True)
    req = p.process_inputs("r", "a b c", SamplingParams(max_tokens=2), priority=3)
    assert (req.prompt, req.prompt_token_ids, req.priority, req.params.max_tokens) == ("a b c", ids, 3, 2)
    assert p.process_inputs("t", {"prompt_token_ids": [1, 2]}).prompt is None
    assert req.max_output_tokens == 2
    with pytest.raises(PromptTooLongError, match="prompt is 8 tokens"):
        p.process_inputs("r", list(range(8)))
    from kvserve.engine.pooling import PoolingParams

    emb = p.process_inputs("e", list(range(8)), pooling_params=PoolingParams())  # a pooling prompt may fill it
    assert emb.params.max_tokens == 0 and emb.pooling is not None
    cases = [
        (dict(prompt=[]), "prompt is empty"),
        (dict(prompt=[len(tok)]), "prompt token ids"),
        (dict(prompt=[True]), "prompt token ids"),
        (dict(prompt="x", priority=1.5), "priority"),
        (dict(prompt="x", params=SamplingParams(stop_token_ids=[len(tok)])), "^stop_token_ids"),
        (dict(prompt="x", params=SamplingParams(logit_bias={len(tok): 1.0})), "^logit_bias"),
        (dict(prompt="x", params="greedy"), "params must be"),
        (dict(prompt="x", lora_request=object()), "enable_lora=True"),
    ]
    for kw, match in cases:
        with pytest.raises(ValueError, match=match):
            p.process_inputs("r", **kw)
    small = InputProcessor(tok, vocab_size=16, eos_token_ids={2}, max_model_len=8)  # logprobs is <= 20 anyway
    with pytest.raises(ValueError, match="^logprobs must be at most the vocabulary size 16"):
        small.process_inputs("r", [1], SamplingParams(logprobs=17))
    with pytest.raises(ValueError, match="^stop_token_ids with min_tokens forbid every token"):
        small.process_inputs("r", [1], SamplingParams(min_tokens=1, stop_token_ids=[t for t in range(16) if t != 2]))
    assert (
        small.process_inputs(
            "r", [1], SamplingParams(min_tokens=1, ignore_eos=True, stop_token_ids=list(range(1, 16)))
        ).params.min_tokens
        == 1
    )
    assert processor(tok, enable_lora=True).process_inputs("r", "x", lora_request="lora").lora_request == "lora"


def test_check_context_length_with_max_tokens(tok):
    p = processor(tok, max_model_len=10)
    p.check_context_length(4, max_tokens=6)
    with pytest.raises(PromptTooLongError, match=r"asks for 11 \(4 in the prompt, 7 in max_tokens\)"):
        p.check_context_length(4, max_tokens=7)
    with pytest.raises(PromptTooLongError, match="prompt is 10 tokens"):
        p.check_context_length(10)
    p.check_context_length(10, pooling=True)


def test_engine_and_async_front_share_it(tiny_llama_path):
    """The engine's make_request, tokenize and chat template, the async front (its own tokenizer)
    and the old engine-level names are the input processor's."""
    import kvserve.engine.input_processor as input_processor
    import kvserve.engine.llm_engine as llm_engine
    from kvserve.engine import EngineConfig
    from kvserve.engine.async_engine import AsyncLLMEngine

    for name in ("parse_prompt", "encode_prompt", "chat_template_ids", "PromptTooLongError"):
        assert getattr(llm_engine, name) is getattr(input_processor, name)
    eng = llm_engine.LLMEngine(
        EngineConfig(model=str(tiny_llama_path), dtype="float32", num_kv_blocks=16, max_model_len=128)
    )
    try:
        tok = eng.tokenizer
        assert eng.input_processor.max_model_len == eng.max_model_len == 128
        want = chat_template_ids(tok, MESSAGES, True, [WEATHER])
        assert eng.apply_chat_template(MESSAGES, tools=[WEATHER]) == want
        with pytest.raises(PromptTooLongError):
            eng.make_request("r", list(range(128)))
        front = AsyncLLMEngine(eng)
        # the front's tokenizer is its event loop's (decoding); every tokenizer thread, and any
        # other thread that asks the input processor, has a copy of its own: none shares it
        pool_toks = [front._tok_pool.submit(lambda: front.input_processor.tokenizer).result() for _ in range(8)]
        here = front.input_processor.tokenizer
        assert all(t is not front.tokenizer and t is not tok for t in [here, *pool_toks])
        assert front.tokenizer is not tok and here is front.input_processor.tokenizer
        assert here.encode("hi there") == front.tokenizer.encode("hi there") == tok.encode("hi there")
        assert asyncio.run(front.apply_chat_template(MESSAGES, [WEATHER])) == want
        assert asyncio.run(front.encode({"prompt": "hi there"})) == tok.encode("hi there")
        front._tok_pool.shutdown()
        front._pool.shutdown()
    finally:
        eng.shutdown()
