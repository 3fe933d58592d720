"""The decode step's C++ layer loop (``kvserve.kernels.cpu_backend.decode_layers``) against the layers run
op by op from Python: the same kernels in the same order, so the same bits: every sampled token and
every logprob equal, while batches shrink through the loop's row limit and on every model shape it
takes (qkv bias, Qwen3's q/k norm, tied and untied heads). Settings it does not take (int8, LoRA,
the torch attention path, a float8 cache) run op by op. Equality with HF transformers is the correctness
suite's (``test_correctness.py`` runs this path on its ``cpu-onednn`` case)."""

import pytest
import torch

from kvserve.engine import LLM, SamplingParams
from kvserve.engine.config import EngineConfig
from kvserve.engine.model_runner import ModelRunner
from kvserve.kernels import cpu_backend
from kvserve.kernels.backend import AttentionMetadata


@pytest.fixture
def calls(monkeypatch):
    """Counts the decode steps that went through the C++ layer loop."""
    if not cpu_backend.load_kernel():
        pytest.skip(f"CPU kernels not built: {cpu_backend.kernel_error()}")
    seen = []
    real = cpu_backend.decode_layers

    def spy(h, *args, **kw):
        seen.append(h.shape[0])
        return real(h, *args, **kw)

    monkeypatch.setattr(cpu_backend, "decode_layers", spy)
    return seen


def _run(llm: LLM, n: int) -> list[tuple[list[int], list[dict[int, float]]]]:
    """``n`` prompts of different lengths, greedy, each to its own length (3 + 2 i tokens), so
    the decode batch shrinks from ``n`` rows to 1; returns each one's tokens and top-5 logprobs."""
    prompts = [[(7 * i + 3 * j) % 400 + 5 for j in range(4 + 3 * i)] for i in range(n)]
    params = [SamplingParams(max_tokens=3 + 2 * i, temperature=0, ignore_eos=True, logprobs=5) for i in range(n)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    stats = llm.get_stats()
    assert stats["free_kv_blocks"] == stats["num_kv_blocks"], "blocks leaked"
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


def _both_paths(llm: LLM, calls: list, monkeypatch, n: int = 11):
    """(with the loop, op by op, rows the loop took) for the same requests on one engine."""
    fused = _run(llm, n)
    rows = list(calls)
    monkeypatch.setattr(cpu_backend, "DECODE_LAYERS", False)
    per_op = _run(llm, n)
    assert len(calls) == len(rows), "the loop ran although switched off"
    return fused, per_op, rows


@pytest.mark.parametrize("model", ["tiny_llama_path", "tiny_qwen2_path", "tiny_qwen3_path", "smollm2_path"])
def test_float32_equals_the_per_op_path(request, model, calls, monkeypatch):
    path = request.getfixturevalue(model)
    llm = LLM(model=str(path), dtype="float32", enable_prefix_caching=False, attention_backend="cpu")
    fused, per_op, rows = _both_paths(llm, calls, monkeypatch)
    # 11 requests: 11-9 rows run op by op, 8 down to 1 in the loop
    assert rows and max(rows) == cpu_backend.DECODE_LAYERS_ROWS and min(rows) == 1
    assert fused == per_op


def test_bfloat16_takes_the_loop(tiny_llama_path, calls, monkeypatch):
    """bfloat16 decode matmuls are the bf16 GEMV's on every CPU (native bf16 dot products where the
    CPU has them, float32 math on widened weights where not), so bfloat16 takes the loop too, up to
    the GEMV's rows (8; larger steps run op by op on oneDNN)."""
    llm = LLM(model=str(tiny_llama_path), dtype="bfloat16", enable_prefix_caching=False, attention_backend="cpu")
    fused, per_op, rows = _both_paths(llm, calls, monkeypatch, n=5)
    assert rows and max(rows) == min(5, cpu_backend.bf16_gemv_rows())
    assert fused == per_op


@pytest.mark.parametrize(
    "kw",
    [{"quantization": "int8"}, {"enable_lora": True}, {"attention_backend": "torch"}, {"kv_cache_dtype": "fp8"}],
    ids=["int8", "lora", "torch-attention", "fp8-kv"],
)
def test_settings_it_does_not_take_run_op_by_op(tiny_llama_path, calls, kw):
    llm = LLM(model=str(tiny_llama_path), **{"dtype": "float32", "enable_prefix_caching": False, **kw})
    _run(llm, 3)
    assert calls == []


def test_the_op_refuses_a_slot_outside_the_cache(tiny_llama_path, calls):
    """A slot past the cache is a RuntimeError, not a write past the cache's memory."""
    runner = ModelRunner(EngineConfig(device="cpu", dtype="float32"), str(tiny_llama_path))
    runner.init_kv_cache(4)
    model = runner.model
    a = model.layers[0].self_attn
    nb, bs = a.k_cache.shape[:2]
    h = torch.randn(1, model.cfg.hidden_size)
    meta = AttentionMetadata(
        cu_seqlens_q=torch.tensor([0, 1], dtype=torch.int32),
        seq_lens=torch.tensor([1], dtype=torch.int32),
        block_tables=torch.zeros(1, 1, dtype=torch.int32),
        slot_mapping=torch.tensor([nb * bs], dtype=torch.long),
        query_lens_cpu=[1],
        seq_lens_cpu=[1],
        max_seqlen_q=1,
        max_seqlen_k=1,
    )
    with torch.inference_mode():
        weights = model._decode_layer_weights(h)
    assert weights is not None
    with torch.inference_mode(), pytest.raises(RuntimeError, match="outside the cache"):
        cpu_backend.decode_layers(
            h,
            None,
            torch.zeros(1, dtype=torch.long),
            weights,
            [lay.self_attn.k_cache for lay in model.layers],
            [lay.self_attn.v_cache for lay in model.layers],
            meta,
            a.rotary.cos,
            a.rotary.sin,
            a.num_heads,
            a.num_kv_heads,
            a.head_dim,
            1e-5,
            a.scale,
        )
