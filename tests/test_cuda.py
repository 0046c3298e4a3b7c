"""The CUDA-only paths: graph capture and replay, the engine on the GPU with the Triton kernels
compiled for real, device memory sizing. Deselected, with a line saying why, where there is no CUDA
device (conftest.py); benchmarks/gpu_run.sh runs them on the GPU machine before the check."""

import pytest
import torch

from core.engine.types import SamplingParams
from tests.tiny import tiny_config

pytestmark = pytest.mark.cuda  # deselected (with a line saying so) where there is no CUDA device
PROMPTS = [[5, 17, 99, 3, 42, 8, 61] * 3, [120, 7], list(range(30, 70)), [9] * 33, [11, 12, 13]]


def _engine(path, device, attention="auto", graphs=None, dtype="fp32"):
    from core.config import AttentionConfig
    from core.engine.engine import Engine
    from plugins.backends.torch_backend import TorchBackendConfig
    from plugins.cache.paged import PagedCacheConfig

    cfg = tiny_config(path, scheduler="continuous", max_num_batched_tokens=32, max_num_seqs=8)
    cfg.model.device, cfg.model.dtype = device, dtype
    cfg.cache = PagedCacheConfig(name="paged", block_size=16, memory_gb=0.01)
    cfg.attention = AttentionConfig(name=attention)
    cfg.backend = TorchBackendConfig(name="torch", cuda_graphs=graphs)
    return Engine(cfg)


def _greedy(engine):
    outs = engine.generate(PROMPTS, SamplingParams(max_tokens=12, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


def test_the_gpu_engine_with_graphs_gives_the_cpu_references_tokens(tiny_dirs):
    want = _greedy(_engine(tiny_dirs["llama"], "cpu", "torch"))
    e = _engine(tiny_dirs["llama"], "cuda")
    assert type(e.attention).__name__ == "TritonAttention" and e.backend.graphs is not None
    replays = []
    run = e.backend.graphs.run
    e.backend.graphs.run = lambda batch: replays.append(batch.attn.num_seqs) or run(batch)
    assert _greedy(e) == want
    assert replays  # decode steps went through the captured graphs


def test_graphs_off_and_on_agree_in_bf16(tiny_dirs):
    eager = _greedy(_engine(tiny_dirs["llama"], "cuda", graphs=False, dtype="bf16"))
    graphed = _greedy(_engine(tiny_dirs["llama"], "cuda", graphs=True, dtype="bf16"))
    assert graphed == eager


def test_the_kv_pool_is_sized_from_the_devices_memory():
    from core.runner.memory import kv_memory_budget

    budget, source = kv_memory_budget(0.5, torch.device("cuda"), reserved_bytes=1 << 30)
    free, total = torch.cuda.mem_get_info()
    assert budget <= 0.5 * total - (total - free) - (1 << 30) + 1e6 and "GB on" in source


def test_quantized_linears_run_the_triton_matmuls_on_cuda():
    from servelab_kernels.quant import Int4Linear, Int8Linear

    w = torch.randn(96, 256, device="cuda")
    x = torch.randn(3, 256, device="cuda", dtype=torch.bfloat16)
    q4 = Int4Linear.from_weight(w, None, 64)
    assert q4.layout == "nibbles"
    ref = x.float() @ q4.dequantized_weight().T
    torch.testing.assert_close(q4(x).float(), ref, atol=0.1, rtol=0.02)
    lin = torch.nn.Linear(256, 96, bias=False).cuda()
    q8 = Int8Linear.from_linear(lin)
    torch.testing.assert_close(q8(x).float(), Int8Linear.from_linear(lin, fast=False)(x).float(), atol=0.05, rtol=0.02)
