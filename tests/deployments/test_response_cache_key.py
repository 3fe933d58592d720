"""The response cache's exact key (kvserve/deployments/cache/), without Ray: every field that changes the
output is in it, the rest declared output-neutral; equal requests spelled differently share it;
which requests are cacheable, the per-request options, the semantic scope and the model revision."""

import pytest
from pydantic import ValidationError
from response_cache_helpers import chat

from kvserve.deployments.cache import (
    NON_OUTPUT_FIELDS,
    RequestOptions,
    deterministic,
    exact_key,
    request_options,
    semantic_parts,
)
from kvserve.deployments.contract.openai_requests import ChatCompletionRequest, CompletionRequest
from kvserve.deployments.contract.types import model_revision


def completion(**kw) -> CompletionRequest:
    return CompletionRequest.model_validate(
        {"prompt": "The capital of France is", "temperature": 0, "max_tokens": 8, **kw}
    )


def key(body, model="m", revision="r1") -> str:
    return exact_key(model, revision, "chat" if isinstance(body, ChatCompletionRequest) else "completion", body)


WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
}

# field -> (extra base fields, the changed value): each must change the key
SAMPLING_VARIANTS = {
    "max_tokens": ({}, 9),
    "temperature": ({}, 0.5),
    "top_p": ({}, 0.5),
    "n": ({}, 2),
    "stop": ({}, ["."]),
    "seed": ({}, 1),
    "presence_penalty": ({}, 0.5),
    "frequency_penalty": ({}, 0.5),
    "logit_bias": ({}, {"5": 1.0}),
    "response_format": ({}, {"type": "json_object"}),
    "top_k": ({}, 5),
    "min_p": ({}, 0.1),
    "repetition_penalty": ({}, 1.1),
    "ignore_eos": ({}, True),
    "min_tokens": ({}, 2),
    "stop_token_ids": ({}, [3]),
    "skip_special_tokens": ({}, False),
    "include_stop_str_in_output": ({}, True),
    "structured_outputs": ({}, {"regex": "a+"}),
    "guided_json": ({}, {"type": "object"}),
    "guided_regex": ({}, "b+"),
    "guided_choice": ({}, ["a", "b"]),
    "guided_grammar": ({}, 'root ::= "a"'),
    "cache_salt": ({}, "tenant-a"),  # output-neutral, but a client's salt keeps its answers apart too
}
CHAT_VARIANTS = {
    **SAMPLING_VARIANTS,
    "messages": ({}, [{"role": "user", "content": "What is the capital of Spain?"}]),
    "max_completion_tokens": ({}, 9),
    "logprobs": ({}, True),
    "top_logprobs": ({"logprobs": True}, 2),
    "tools": ({}, [WEATHER]),
    "tool_choice": ({"tools": [WEATHER]}, "required"),
    "parallel_tool_calls": ({"tools": [WEATHER]}, False),
    "chat_template_kwargs": ({}, {"enable_thinking": False}),
}
COMPLETION_VARIANTS = {
    **SAMPLING_VARIANTS,
    "prompt": ({}, "The capital of Spain is"),
    "logprobs": ({}, 1),
    "echo": ({}, True),
    "best_of": ({}, 2),
    "suffix": ({}, ""),
}


@pytest.mark.parametrize(
    "model,variants", [(ChatCompletionRequest, CHAT_VARIANTS), (CompletionRequest, COMPLETION_VARIANTS)]
)
def test_every_request_field_is_in_the_key_or_declared_output_neutral(model, variants):
    """A field added to the protocol must be decided on: in the key (a variant here) or in
    NON_OUTPUT_FIELDS. Nothing is silently left out of the key."""
    assert set(variants) | NON_OUTPUT_FIELDS == set(model.model_fields)


@pytest.mark.parametrize("field", sorted(CHAT_VARIANTS))
def test_each_output_changing_chat_field_changes_the_key(field):
    extra, value = CHAT_VARIANTS[field]
    assert key(chat(**extra)) != key(chat(**extra, **{field: value}))


@pytest.mark.parametrize("field", sorted(COMPLETION_VARIANTS))
def test_each_output_changing_completion_field_changes_the_key(field):
    extra, value = COMPLETION_VARIANTS[field]
    assert key(completion(**extra)) != key(completion(**extra, **{field: value}))


def test_model_revision_and_endpoint_change_the_key():
    b = chat()
    assert len({key(b), key(b, model="other"), key(b, revision="r2"), exact_key("m", "r1", "completion", b)}) == 4


def test_fields_that_do_not_change_the_output_leave_the_key_alone():
    base = key(chat())
    for extra in (
        {"stream": True},
        {"stream": True, "stream_options": {"include_usage": True}},
        {"user": "u1"},
        {"priority": 5},
        {"cache": {"semantic": True}},
        {"cache": True},
        {"model": "anything"},
        {"metadata": {"trace": "x"}, "unknown_vendor_field": 1},
    ):
        assert key(chat(**extra)) == base, extra
    assert key(completion(stream=True, user="u")) == key(completion())


def test_equal_requests_spelled_differently_have_one_key():
    parts = [{"type": "text", "text": "What is the capital "}, {"type": "text", "text": "of France?"}]
    assert key(chat(messages=[{"role": "user", "content": parts}])) == key(chat())
    assert key(chat(max_tokens=None, max_completion_tokens=8)) == key(chat())
    assert key(chat(stop=".")) == key(chat(stop=["."]))
    assert key(chat(temperature=0.0)) == key(chat(temperature=0))
    assert key(chat(temperature=None, seed=3)) == key(chat(temperature=1.0, seed=3))
    assert key(chat(top_p=1.0)) == key(chat())
    assert key(chat(response_format={"type": "json_object"})) == key(chat(structured_outputs={"json_object": True}))
    assert key(chat(guided_regex="a+")) == key(chat(structured_outputs={"regex": "a+"}))
    assert key(chat(logit_bias={"7": 1, "5": 2})) == key(chat(logit_bias={"5": 2.0, "7": 1.0}))
    assert key(completion(prompt=["The capital of France is"])) == key(completion())
    # a system message is part of the conversation: not equal
    system = [{"role": "system", "content": "Answer in French."}, *chat().model_dump()["messages"]]
    assert key(chat(messages=system)) != key(chat())


def test_only_deterministic_requests_are_cacheable():
    assert deterministic(chat()) and deterministic(chat(temperature=0, n=3))
    assert deterministic(chat(temperature=0.8, seed=7, n=3))  # choice i samples with seed + i
    assert not deterministic(chat(temperature=None)) and not deterministic(chat(temperature=0.7))


def test_request_options_from_body_and_cache_control():
    h = {}
    assert request_options(chat(), h) == RequestOptions(True, True, None)
    assert request_options(chat(cache=False), h) == RequestOptions(False, False, False)
    assert request_options(chat(cache={"semantic": True}), h) == RequestOptions(True, True, True)
    assert request_options(chat(cache={"semantic": False}), h).semantic is False
    assert request_options(chat(), {"cache-control": "no-cache"}) == RequestOptions(False, True, None)
    assert request_options(chat(), {"cache-control": "max-age=0, no-store"}) == RequestOptions(False, False, False)
    with pytest.raises(ValidationError, match="semantik"):
        chat(cache={"semantik": True})  # a typo is a 400, not silently ignored
    assert (
        "cache"
        not in ChatCompletionRequest.model_validate(
            {"messages": [{"role": "user", "content": "x"}], "cache": False}
        ).model_extra
    )


def test_semantic_parts_leave_the_text_out_of_the_scope():
    s1, t1 = semantic_parts("m", "r", "chat", chat())
    s2, t2 = semantic_parts("m", "r", "chat", chat(messages=[{"role": "user", "content": "Capital of France?"}]))
    assert s1 == s2 and t1 == "What is the capital of France?" and t2 == "Capital of France?"
    sys_msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital of France?"}]
    assert semantic_parts("m", "r", "chat", chat(messages=sys_msgs))[0] != s1
    assert semantic_parts("m", "r", "chat", chat(max_tokens=9))[0] != s1
    assert semantic_parts("m", "r2", "chat", chat())[0] != s1
    tool_last = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "content": "42", "tool_call_id": "c"},
    ]
    assert semantic_parts("m", "r", "chat", chat(messages=tool_last)) is None
    assert semantic_parts("m", "r", "completion", completion(prompt=[1, 2, 3])) is None
    assert semantic_parts("m", "r", "completion", completion())[1] == "The capital of France is"


def test_model_revision_follows_the_weights(tmp_path):
    (tmp_path / "config.json").write_text('{"hidden_size": 64}')
    (tmp_path / "model.safetensors").write_bytes(b"x" * 100)
    r1 = model_revision(tmp_path)
    assert r1.startswith("sha256:") and model_revision(tmp_path) == r1
    (tmp_path / "model.safetensors").write_bytes(b"y" * 101)
    r2 = model_revision(tmp_path)
    assert r2 != r1
    (tmp_path / "config.json").write_text('{"hidden_size": 65}')
    assert model_revision(tmp_path) != r2
    snap = tmp_path / "snapshots" / ("a1" * 20)
    snap.mkdir(parents=True)
    assert model_revision(snap) == "hub:" + "a1" * 20
