"""A LoRA adapter served live (the shared app's tiny model serves ``tiny-lora``), through the
openai SDK: ``/v1/models`` lists it with its base as ``parent``; completions and streamed chat
naming it answer with the adapter's tokens (equal to the engine's offline ``LLM`` with the same
adapter, which ``tests/engine/test_lora.py`` holds equal to HF with PEFT) and carry its name."""

import pytest

pytestmark = pytest.mark.slow


def test_sdk_calls_with_an_adapter_as_model(serve_app):
    from openai import OpenAI

    from kvserve.engine import LLM, SamplingParams
    from kvserve.engine.lora import LoRARequest

    client = OpenAI(base_url=serve_app.base_url, api_key="unused")
    cards = {m.id: m for m in client.models.list().data}
    assert cards["tiny-lora"].model_extra["parent"] == "tiny"
    assert client.models.retrieve("tiny-lora").model_extra["parent"] == "tiny"

    prompt = "Once upon a time"
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the served tiny model (torch_num_threads 1): the same summation order
    offline = LLM(model=str(serve_app.tiny_path), max_model_len=256, enable_lora=True, max_lora_rank=16)
    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    want = [
        o.outputs[0].text
        for o in offline.generate(
            [prompt] * 2,
            sp,
            lora_request=[LoRARequest("tiny-lora", 1, str(serve_app.tiny_lora_path)), None],
            use_tqdm=False,
        )
    ]
    offline.engine.shutdown()
    torch.set_num_threads(threads)
    assert want[0] != want[1]  # the adapter changes the answer

    got = client.completions.create(
        model="tiny-lora", prompt=prompt, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    assert got.model == "tiny-lora" and got.choices[0].text == want[0]
    base = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    assert base.choices[0].text == want[1]

    stream = client.chat.completions.create(
        model="tiny-lora", messages=[{"role": "user", "content": "hi"}], max_tokens=8, temperature=0, stream=True
    )
    chunks = list(stream)
    assert chunks and all(c.model == "tiny-lora" for c in chunks)
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")
