"""Helpers of test_openai_clients.py (and the live checks of tests/e2e/test_openai_api.py): the
messages, JSON schema, tools and prompts its requests send, a POST to an app's OpenAI API, and a
completions response made acceptable to the openai SDK's type.
"""

import json

import httpx
from helpers import HTTP

PARIS = [{"role": "user", "content": "What is the capital of France?"}]

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "city": {"type": "string", "enum": ["Paris", "London", "Tokyo", "Other"]},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 3},
    },
    "required": ["name", "age", "city", "hobbies"],
    "additionalProperties": False,
}

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 30},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Current time in a timezone",
        "parameters": {
            "type": "object",
            "properties": {"timezone": {"type": "string", "maxLength": 30}},
            "required": ["timezone"],
            "additionalProperties": False,
        },
    },
}

PROMPTS = [
    "Describe a person who lives in Paris.",
    "Invent a retired teacher from London.",
    "Make up a Tokyo chef.",
    "Write a profile for a young painter.",
    "Give me a character for a novel.",
    "Describe your best friend.",
    "Create a sports fan from London.",
    "Profile of a software engineer.",
    "Tell me about a musician in Paris.",
    "Invent a scientist.",
    "A gardener who loves roses.",
    "A child who likes trains.",
    "Someone who travels a lot.",
    "A baker in Tokyo.",
    "An old sailor.",
    "A student of history.",
    "A nurse working nights.",
    "A chess champion.",
    "A librarian from Paris.",
    "A mountain climber.",
]


def post(app, path: str, body: dict, **kw) -> httpx.Response:
    """POST ``body`` to ``app.base_url + path`` (``app``: an app's URLs, as the fixtures give them)."""
    return HTTP.post(f"{app.base_url}{path}", json=body, timeout=kw.pop("timeout", 300), **kw)


def nulls_dropped(resp: dict) -> dict:
    """A completions response with the echoed first token's null logprobs left out (OpenAI
    sends them; the SDK's pydantic type does not admit them)."""
    resp = json.loads(json.dumps(resp))
    for c in resp["choices"]:
        lp = c.get("logprobs")
        if lp and lp["token_logprobs"] and lp["token_logprobs"][0] is None:
            for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                lp[key] = lp[key][1:]
    return resp
