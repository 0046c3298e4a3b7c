"""The C++ CPU decode attention against its torch reference, and the tiny model end to end with it."""

import pytest
import torch

from core.errors import ConfigError
from servelab_kernels import attention as ref
from servelab_kernels import cpu_attention
from tests.tiny import scattered_kv_cache


def test_the_kernel_builds_here():
    assert cpu_attention.available()  # gcc and Python's headers are on every machine this project runs on


@pytest.mark.parametrize("portable", [False, True], ids=["native", "portable"])  # AVX-512 (where built) and the loop
@pytest.mark.parametrize("group, d", [(1, 64), (3, 64), (8, 64), (4, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_decode_matches_the_reference(group, d, dtype, portable):
    ctx_lens = [1, 17, 33, 100, 47]  # crossing block boundaries and tiles; blocks scattered over the pool
    kc, vc, scales, bt = scattered_kv_cache(ctx_lens, 2, d, dtype, seed=group)
    q = torch.randn(len(ctx_lens), 2 * group, d, generator=torch.Generator().manual_seed(1))
    if dtype == torch.bfloat16:
        q = q.bfloat16()
    lens = torch.tensor(ctx_lens)
    want = ref.decode_attention(q.float(), kc, vc, bt, lens, 0.125, *scales)
    got = cpu_attention.decode_attention(q, kc, vc, bt, lens, 0.125, *scales, portable=portable)
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: the reference's scores are rounded to bf16
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def assert_reads_the_scale_and_the_scales(got, q, kc, vc, bt, lens, scales, same):
    """`got` (decode at scale 0.125, its last row a padding row of no context) is zeros on that row and
    changes, by `same`'s measure, with the scale and with either INT8 scale tensor doubled."""
    assert torch.equal(got[-1], torch.zeros_like(got[-1]))  # an empty context attends over nothing
    assert not same(got, cpu_attention.decode_attention(q, kc, vc, bt, lens, 0.25, *scales))  # it reads its inputs
    if scales:  # and the scales: a key's on its scores, a value's on its row
        for i in (0, 1):
            doubled = [s.clone() for s in scales]
            doubled[i] *= 2
            assert not same(got, cpu_attention.decode_attention(q, kc, vc, bt, lens, 0.125, *doubled))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int8])
@pytest.mark.parametrize("group, d, block_size", [(3, 64, 64), (4, 128, 16), (16, 128, 64), (6, 64, 32)])
def test_two_pass_decode_matches_the_reference_and_the_one_pass_kernel(group, d, block_size, dtype):
    # 1 and 17 end mid-tile, 63 / 65 on either side of a 64-key block's end, 300 several blocks; the
    # groups 3 and 4 have their own code, 6 and 16 the general loop
    ctx_lens = [1, 17, 63, 65, 300]
    kc, vc, scales, bt = scattered_kv_cache(ctx_lens, 2, d, dtype, seed=group, block_size=block_size,
                                            num_blocks=64 * 16 // block_size)
    bt, lens = torch.cat([bt, bt[:1]]), torch.tensor(ctx_lens + [0])  # and a padding row of no context
    q = torch.randn(len(lens), 2 * group, d, generator=torch.Generator().manual_seed(4)).bfloat16()
    with cpu_attention.amx_decode(False):
        two = cpu_attention.decode_attention(q, kc, vc, bt, lens, 0.125, *scales)
        with cpu_attention.two_pass_decode(False):
            one = cpu_attention.decode_attention(q, kc, vc, bt, lens, 0.125, *scales)
    want = ref.decode_attention(q[:-1].float(), kc, vc, bt[:-1], lens[:-1], 0.125, *scales)
    torch.testing.assert_close(two[:-1].float(), want.float(), atol=2e-2, rtol=2e-2)
    # the same products; the probabilities are taken against the context's max instead of a running
    # one and rounded to bf16 (the one-pass kernel keeps an INT8 cache's in fp32): a few units in the
    # last place apart
    torch.testing.assert_close(two.float(), one.float(), atol=2e-2, rtol=1.6e-2)
    assert_reads_the_scale_and_the_scales(two, q, kc, vc, bt, lens, scales, torch.equal)


@pytest.mark.parametrize("portable", [False, True], ids=["native", "portable"])  # AVX-512 lanes and the loop
def test_write_and_decode_quantizes_an_int8_cache_as_the_reference_does(portable):
    from servelab_kernels.attention import write_kv

    # a decode step's new tokens: one each for 48 sequences whose earlier tokens are in the cache (288
    # rows quantized: a reciprocal in place of the division would be a unit off in some)
    ctx_lens = [5, 40, 70] + [(37 * i) % 90 + 1 for i in range(45)]
    kc, vc, scales, bt = scattered_kv_cache(ctx_lens, 3, 64, torch.int8, seed=7, block_size=16, num_blocks=320)
    g = torch.Generator().manual_seed(8)
    k, v = (torch.randn(48, 3, 64, generator=g).bfloat16() * 3 for _ in range(2))
    k[0, 0, :4] = torch.tensor([127.0, 2.5, -3.5, 0.5])  # scale exactly 1: ties, rounded half to even
    v[1, 2] = 0.0  # an all-zero row: the scale's floor
    slots = torch.tensor([bt[i, n // 16].item() * 16 + n % 16 for i, n in enumerate(ctx_lens)])
    lens = torch.tensor(ctx_lens) + 1
    q = torch.randn(48, 9, 64, generator=g).bfloat16()
    want_caches = [t.clone() for t in (kc, vc, *scales)]
    write_kv(k, v, want_caches[0], want_caches[1], slots, *want_caches[2:])
    want = ref.decode_attention(q.float(), want_caches[0], want_caches[1], bt, lens, 0.125, *want_caches[2:])
    got = cpu_attention.load(portable).write_and_decode(q, k, v, kc, vc, slots, bt, lens, 0.125, *scales)
    for mine, theirs in zip((kc, vc, *scales), want_caches):  # the C++ quantizer is the reference's twin
        assert torch.equal(mine, theirs)
    assert kc[bt[0, 0], 0, 5, :4].tolist() == [127, 2, -4, 0]
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    with pytest.raises(RuntimeError, match="needs its k_scale and v_scale"):
        cpu_attention.load(portable).write_and_decode(q, k, v, kc, vc, slots, bt, lens, 0.125, None, None)


@pytest.mark.avx2
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("group, d, block_size", [(3, 64, 64), (4, 128, 16), (8, 64, 8), (5, 128, 32), (1, 64, 16)])
def test_avx2_decode_matches_the_reference_and_the_portable_loop(group, d, block_size, dtype):
    # 1 and 7 end inside the first 8-key tile, 9 just past it, 63 / 65 on either side of a 64-key
    # block's end, 300 several blocks; groups 1-8 have their own code (4-6 and 7-8 narrower slices)
    ctx_lens = [1, 7, 9, 63, 65, 300]
    kc, vc, scales, bt = scattered_kv_cache(ctx_lens, 2, d, dtype, seed=group, block_size=block_size,
                                            num_blocks=64 * 16 // block_size)
    bt, lens = torch.cat([bt, bt[:1]]), torch.tensor(ctx_lens + [0])  # and a padding row of no context
    q = torch.randn(len(lens), 2 * group, d, generator=torch.Generator().manual_seed(5))
    assert cpu_attention.avx2_decode_built()
    got = cpu_attention.decode_attention(q, kc, vc, bt, lens, 0.125, *scales)
    with cpu_attention.avx2_decode(False):
        loop = cpu_attention.decode_attention(q, kc, vc, bt, lens, 0.125, *scales)
    want = ref.decode_attention(q[:-1], kc, vc, bt[:-1], lens[:-1], 0.125, *scales)
    # the reference multiplies a bf16 cache in bf16; the kernel widens it to fp32, as the loop does
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(got[:-1], want, atol=tol, rtol=tol)
    # the same fp32 products as the loop, summed in another order and with the exact softmax's max
    torch.testing.assert_close(got, loop, atol=2e-6, rtol=1e-5)
    assert_reads_the_scale_and_the_scales(got, q, kc, vc, bt, lens, scales, torch.allclose)


@pytest.mark.avx2
@pytest.mark.parametrize("group, d, block_size", [(9, 64, 16), (3, 64, 4), (3, 32, 16)])
def test_avx2_decode_leaves_what_it_does_not_serve_to_the_loop(group, d, block_size):
    """Over 8 query heads a KV head, blocks not a multiple of 8 keys, a head_dim other than 64 / 128:
    the portable loop's result, bit for bit."""
    kc, vc, _, bt = scattered_kv_cache([5, 40], 1, d, torch.float32, seed=2, block_size=block_size,
                                       num_blocks=64 * 16 // block_size)
    q, lens = torch.randn(2, group, d, generator=torch.Generator().manual_seed(6)), torch.tensor([5, 40])
    got = cpu_attention.decode_attention(q, kc, vc, bt, lens, 0.125)
    with cpu_attention.avx2_decode(False):
        assert torch.equal(got, cpu_attention.decode_attention(q, kc, vc, bt, lens, 0.125))
    torch.testing.assert_close(got, ref.decode_attention(q, kc, vc, bt, lens, 0.125), atol=1e-5, rtol=1e-5)


def test_a_bf16_cache_under_an_fp32_model(tiny_dirs):
    """cache.dtype=bf16 stores K and V in bf16 while the model computes in fp32: the C++ kernels and
    the torch reference widen the same stored values, so their logits agree to fp32 rounding (exactly
    where both prefill through SDPA), and both stay within bf16's rounding of the fp32 cache's."""
    from core.config.compose import compose
    from core.engine.components import engine_config
    from core.engine.engine import Engine
    from core.model.quantize import forward_prompt

    prompt = [5, 17, 99, 3, 42, 8, 61] * 6

    def logits(*overrides):
        e = Engine(engine_config(compose([f"model.path={tiny_dirs['llama']}", "model.dtype=fp32",
                                          "cache.block_size=16", "cache.memory_gb=0.01", *overrides])))
        caches = e.attention.allocate_kv_cache(8, 16, e.kv_spec, e.device)
        return forward_prompt(e.model, prompt, e.attention, e.kv_spec).float(), caches[0][0].dtype, e.kv_spec

    cpp, cache_dtype, spec = logits("attention=cpu", "cache.dtype=bf16")
    torch_ref, _, _ = logits("attention=torch", "cache.dtype=bf16")
    cpp_sdpa, _, _ = logits("attention=cpu", "cache.dtype=bf16", "attention.prefill=sdpa")
    fp32, fp32_cache, fp32_spec = logits("attention=cpu")
    assert cache_dtype == torch.bfloat16 and fp32_cache == torch.float32
    assert spec.bytes_per_token * 2 == fp32_spec.bytes_per_token
    torch.testing.assert_close(cpp_sdpa, torch_ref, atol=1e-4, rtol=1e-4)
    # the C++ prefill (AVX2 or AVX512-BF16 where built) sums in another order: its attention output is
    # within fp32 rounding (1e-6), but the next layer's keys and values are rounded to bf16, where such a
    # difference can move a value across a rounding boundary (an ulp, 0.4 %): 2.2e-4 measured
    torch.testing.assert_close(cpp, torch_ref, atol=1e-3, rtol=1e-3)
    assert 0 < (cpp - fp32).abs().max() < 5e-2


@pytest.mark.amx_bf16
@pytest.mark.parametrize("group, d, block_size", [(3, 64, 16), (8, 128, 32), (16, 64, 16)])
def test_amx_decode_matches_the_reference_and_the_vector_kernel(group, d, block_size):
    # 1 and 17 keys end mid-tile, 100 spans blocks, 300 several of the tile kernel's 32-key P.V tiles
    ctx_lens = [1, 17, 100, 300, 47]
    kc, vc, scales, bt = scattered_kv_cache(ctx_lens, 2, d, torch.bfloat16, seed=group, block_size=block_size,
                                            num_blocks=64 * 16 // block_size)
    q = torch.randn(len(ctx_lens), 2 * group, d, generator=torch.Generator().manual_seed(3)).bfloat16()
    lens = torch.tensor(ctx_lens)
    assert cpu_attention.amx_decode_ready()
    tiles = cpu_attention.decode_attention(q, kc, vc, bt, lens, 0.125)
    with cpu_attention.amx_decode(False):
        vector = cpu_attention.decode_attention(q, kc, vc, bt, lens, 0.125)
    want = ref.decode_attention(q.float(), kc, vc, bt, lens, 0.125)
    torch.testing.assert_close(tiles.float(), want.float(), atol=2e-2, rtol=2e-2)
    # the same fp32 sums in another order, rounded to bf16 at the end: at most a unit in the last place apart
    torch.testing.assert_close(tiles.float(), vector.float(), atol=1e-2, rtol=8e-3)
    assert not torch.equal(tiles, cpu_attention.decode_attention(q, kc, vc, bt, lens, 0.25))  # it reads its inputs
    # bf16 queries are read as they are and the output written in bf16 (no converted copies): the same
    # sums as the fp32 queries' path, rounded once
    assert torch.equal(tiles, cpu_attention.decode_attention(q.float(), kc, vc, bt, lens, 0.125).bfloat16())


@pytest.mark.parametrize("portable", [False, True], ids=["native", "portable"])
@pytest.mark.parametrize("group, d, dtype", [(3, 64, torch.bfloat16), (1, 64, torch.bfloat16), (4, 128, torch.bfloat16),
                                             (3, 64, torch.float32)])
def test_prefill_matches_the_reference(group, d, dtype, portable):
    # fresh prompts, chunks over a cached prefix (one ending mid-block), a 1-query chunk; 40 > one
    # tile of 16 queries, 100 > several blocks of keys
    ctx_lens, q_lens = [40, 100, 37, 1, 18], [40, 30, 5, 1, 17]
    kc, vc, _, bt = scattered_kv_cache(ctx_lens, 2, d, dtype, seed=group)
    starts = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist())
    q = torch.randn(int(starts[-1]), 2 * group, d, generator=torch.Generator().manual_seed(2)).to(dtype)
    lens = torch.tensor(ctx_lens)
    want = ref.prefill_attention(q, kc, vc, bt, lens, starts, 0.125)
    got = cpu_attention.prefill_attention(q, kc, vc, bt, lens, starts, 0.125, portable=portable)
    assert got.dtype == dtype
    # bf16: P rounded to bf16 before P.V, and the output's own rounding (about 0.008 at 1-2)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.amx_bf16
@pytest.mark.parametrize("group, d, block_size", [(3, 64, 16), (4, 128, 32), (16, 64, 16), (1, 64, 64)])
def test_amx_prefill_matches_the_reference_and_the_vector_kernel(group, d, block_size):
    # fresh prompts, chunks over a cached prefix, a 1-query chunk; 77 x 3 rows end mid-task, 300 keys
    # span several 32-key P tiles, 37 and 18 end mid-tile, and the first row of a task is not its shortest
    ctx_lens, q_lens = [40, 100, 37, 1, 18, 300], [40, 30, 5, 1, 17, 77]
    kc, vc, _, bt = scattered_kv_cache(ctx_lens, 2, d, torch.bfloat16, seed=group, block_size=block_size,
                                       num_blocks=64 * 16 // block_size)
    starts = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist())
    q = torch.randn(int(starts[-1]), 2 * group, d, generator=torch.Generator().manual_seed(4)).bfloat16()
    lens = torch.tensor(ctx_lens)
    assert cpu_attention.prefill_on_tiles(kc) and cpu_attention.prefill_fast(kc)
    tiles = cpu_attention.prefill_attention(q, kc, vc, bt, lens, starts, 0.125)
    with cpu_attention.amx_prefill(False):
        assert not cpu_attention.prefill_on_tiles(kc)
        vector = cpu_attention.prefill_attention(q, kc, vc, bt, lens, starts, 0.125)
    want = ref.prefill_attention(q, kc, vc, bt, lens, starts, 0.125)
    torch.testing.assert_close(tiles.float(), want.float(), atol=2e-2, rtol=2e-2)
    # the same bf16 products summed in another order: within a unit in the last place of the output
    torch.testing.assert_close(tiles.float(), vector.float(), atol=1.6e-2, rtol=8e-3)
    assert not torch.equal(tiles, cpu_attention.prefill_attention(q, kc, vc, bt, lens, starts, 0.25))


def test_the_vector_prefill_serves_smollm2s_bf16_cache():
    kc = torch.zeros(2, 3, 16, 64, dtype=torch.bfloat16)
    avx512_bf16, avx2 = "avx512_bf16" in open("/proc/cpuinfo").read(), cpu_attention.avx2_decode_built()
    assert cpu_attention.prefill_fast(kc) == (avx512_bf16 or avx2)
    # without AVX-512 the AVX2 kernel takes fp32 caches too (head_dim a multiple of 16)
    assert cpu_attention.prefill_fast(kc.float()) == avx2
    assert not cpu_attention.prefill_fast(torch.zeros(2, 3, 16, 40))


@pytest.mark.avx2
@pytest.mark.parametrize("group, d, dtype, block_size", [(3, 64, torch.float32, 16), (3, 64, torch.bfloat16, 16),
                                                         (1, 64, torch.float32, 64), (8, 128, torch.float32, 16),
                                                         (64, 16, torch.float32, 8), (2, 32, torch.bfloat16, 1)])
def test_the_avx2_prefill_matches_the_reference_and_the_loop(group, d, dtype, block_size):
    # 77 x 3 rows end mid-task (48 rows: 16 positions of 3 heads), 300 keys span many 24-key tiles and
    # blocks, 37 and 18 end mid-tile, a 1-query chunk; 64 heads a KV head make one position a task of
    # 64 rows, and blocks of 1 key move every key to another block
    ctx_lens, q_lens = [40, 100, 37, 1, 18, 300], [40, 30, 5, 1, 17, 77]
    kc, vc, _, bt = scattered_kv_cache(ctx_lens, 2, d, dtype, seed=group, block_size=block_size,
                                       num_blocks=64 * 16 // block_size)
    starts = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist())
    q = torch.randn(int(starts[-1]), 2 * group, d, generator=torch.Generator().manual_seed(5)).to(dtype)
    lens = torch.tensor(ctx_lens)
    assert cpu_attention.prefill_fast(kc)
    vector = cpu_attention.prefill_attention(q, kc, vc, bt, lens, starts, 0.125)
    with cpu_attention.avx2_prefill(False):
        assert not cpu_attention.prefill_fast(kc)
        loop = cpu_attention.prefill_attention(q, kc, vc, bt, lens, starts, 0.125)
    want = ref.prefill_attention(q, kc, vc, bt, lens, starts, 0.125)
    # fp32 throughout: the reference's values to rounding; bf16: the output's own rounding (1-2 units)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(vector.float(), want.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(vector.float(), loop.float(), atol=tol, rtol=tol)
    assert not torch.equal(vector, cpu_attention.prefill_attention(q, kc, vc, bt, lens, starts, 0.25))


@pytest.mark.parametrize("choice", ["auto", "cpp", "sdpa"])
def test_attention_prefill_picks_the_kernel_it_names(choice):
    from plugins.attention.cpu_attn import CPUAttention, CPUAttentionConfig

    attn = CPUAttention(CPUAttentionConfig(name="cpu", prefill=choice))
    kc = torch.zeros(2, 3, 16, 64, dtype=torch.bfloat16)
    flags = open("/proc/cpuinfo").read()
    # with AMX tiles, the C++ kernel's tile path beats SDPA's; without AVX-512 its AVX2 kernel does
    auto = "avx512_bf16" in flags or cpu_attention.avx2_decode_built()
    assert attn.cpp_prefill(kc) == {"auto": auto, "cpp": True, "sdpa": False}[choice]


def test_an_unknown_attention_prefill_is_refused_when_the_config_is_read():
    from core.engine.registry import get_registry

    with pytest.raises(ConfigError, match="attention.prefill must be auto, cpp or sdpa, got 'flash'"):
        get_registry().config("attention", {"name": "auto", "prefill": "flash"})


def test_an_unknown_attention_decode_is_refused_when_the_config_is_read():
    from core.engine.registry import get_registry

    with pytest.raises(ConfigError, match="attention.decode must be auto or portable, got 'avx2'"):
        get_registry().config("attention", {"name": "cpu", "decode": "avx2"})


def test_attention_decode_portable_runs_the_portable_builds_kernel_with_the_same_tokens(tiny_dirs):
    """The A/B switch: decode steps (the native plan's op and the eager path's rows) on the portable
    loop, the same greedy tokens as this CPU's own kernel in fp32."""
    from core.config.compose import compose
    from core.engine.components import engine_config
    from core.engine.engine import Engine
    from core.engine.types import SamplingParams

    prompts = [[5, 17, 99, 3, 42, 8, 61] * 3, [120, 7], list(range(30, 70))]

    def run(decode, native):
        e = Engine(engine_config(compose([f"model.path={tiny_dirs['llama']}", "model.dtype=fp32", "attention=cpu",
                                          f"attention.decode={decode}", f"backend.native_decode={native}",
                                          "cache.memory_gb=0.01"])))
        outs = e.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
        return e.attention, [o.outputs[0].token_ids for o in outs]

    auto, want = run("auto", "true")
    portable, got = run("portable", "true")
    assert got == want and run("portable", "false")[1] == want
    assert portable.decode_op(()) == "servelab_cpu_attention_portable::write_and_decode"
    assert auto.decode_op(()) == "servelab_cpu_attention::write_and_decode"
    assert portable.decode_kernels is cpu_attention.load(portable=True) and auto.decode_kernels is cpu_attention.load()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int8, torch.float32])
def test_the_read_floor_reads_exactly_the_contexts_rows(dtype):
    kc, vc, _, bt = scattered_kv_cache([1, 17, 100, 5, 47], 2, 64, dtype, seed=4)
    ctx_lens = [1, 17, 100, 0, 47]  # an empty row reads nothing
    words = 0
    for seq, ctx in enumerate(ctx_lens):  # its twin: the same rows gathered, their 64-bit words summed exactly
        for cache in (kc, vc):
            rows = cache[bt[seq]].transpose(1, 2).reshape(-1, cache.shape[1], cache.shape[3])[:ctx]
            halves = rows.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF  # little-endian words
            words += int(halves[..., 0::2].sum()) + (int(halves[..., 1::2].sum()) << 32)
    assert cpu_attention.read_blocks(kc, vc, bt, torch.tensor(ctx_lens)) == words % 2**64
    assert cpu_attention.read_blocks(kc, vc, bt, torch.tensor([1, 17, 99, 0, 47])) != words  # one row fewer


def test_shared_blocks_and_an_empty_row():
    kc, vc, _, bt = scattered_kv_cache([40], 1, 64, torch.float32, seed=5)
    bt = torch.cat([bt, bt, bt])  # three sequences over the same blocks (a shared prefix)
    lens = torch.tensor([40, 20, 0])  # the last is padding: it attends over nothing
    q = torch.randn(3, 4, 64)
    got = cpu_attention.decode_attention(q, kc, vc, bt, lens, 0.125)
    torch.testing.assert_close(got[:2], ref.decode_attention(q[:2], kc, vc, bt[:2], lens[:2], 0.125), atol=1e-5,
                               rtol=1e-5)
    assert torch.equal(got[2], torch.zeros(4, 64))


def test_tiny_model_greedy_tokens_are_the_same_with_the_cpu_backend(tiny_dirs):
    from core.config import AttentionConfig
    from core.engine.engine import Engine
    from core.engine.types import SamplingParams
    from plugins.attention.cpu_attn import CPUAttentionConfig
    from plugins.cache.paged import PagedCacheConfig
    from tests.tiny import tiny_config

    prompts = [[5, 17, 99, 3, 42, 8, 61] * 3, [120, 7], list(range(30, 70)), [9] * 33]

    def greedy(attention, **kw):
        cfg = tiny_config(tiny_dirs["llama"], scheduler="continuous", max_num_batched_tokens=32)
        cfg.cache = PagedCacheConfig(name="paged", block_size=16, memory_gb=0.01)
        cfg.attention = CPUAttentionConfig(name=attention, **kw) if kw else AttentionConfig(name=attention)
        e = Engine(cfg)
        outs = e.generate(prompts, SamplingParams(max_tokens=10, ignore_eos=True))
        return type(e.attention).__name__, [o.outputs[0].token_ids for o in outs]

    name, want = greedy("torch")
    assert greedy("cpu") == ("CPUAttention", want)
    assert greedy("cpu", prefill="cpp") == greedy("cpu", prefill="sdpa") == ("CPUAttention", want)
    assert greedy("auto")[0] == "CPUAttention"  # the default on the CPU


@pytest.mark.real_model
def test_real_model_same_tokens_with_the_cpu_kernels(default_gguf):
    """The embedded model, greedy, prefill in chunks of 16, each prompt on its own so every step's
    logits row belongs to one sequence. fp32: the C++ kernels give the reference backend's tokens.
    bf16 cannot promise the same tokens (a near-tie is decided by rounding), so its tolerance is
    stated against fp32: up to the first token where any run differs, the C++ kernels' bf16 logits
    are no further from fp32 than 1.5x the reference backend's own bf16 error (mean and max), and
    the mean error stays under 0.25 (logits span about +-30 here)."""
    from core.config import AttentionConfig, EngineConfig, ModelConfig, SchedulerConfig
    from core.engine.engine import Engine
    from core.engine.types import SamplingParams

    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]

    def run(attention, dtype):
        cfg = EngineConfig(model=ModelConfig(dtype=dtype, max_model_len=256),
                           scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16),
                           attention=AttentionConfig(name=attention))
        e = Engine(cfg)
        seen, accept = [], e.decoder.accept

        def spy(logits, sch, prop):
            if logits.shape[0]:
                seen.append(logits[0].float().clone())
            return accept(logits, sch, prop)

        e.decoder.accept = spy
        results = []
        for prompt in prompts:
            seen.clear()
            out = e.generate([prompt], SamplingParams(max_tokens=16, ignore_eos=True))[0]
            results.append((out.outputs[0].token_ids, list(seen)))
        return results

    fp32, fp32_cpu = run("torch", "fp32"), run("cpu", "fp32")
    assert [t for t, _ in fp32_cpu] == [t for t, _ in fp32]
    ref_err, cpu_err = [], []
    for (t32, l32), (tr, lr), (tc, lc) in zip(fp32, run("torch", "bf16"), run("cpu", "bf16")):
        assert len(l32) == len(lr) == len(lc) == 16
        n = next((i for i, abc in enumerate(zip(t32, tr, tc)) if len(set(abc)) > 1), 15)
        ref_err += [(lr[i] - l32[i]).abs() for i in range(n + 1)]
        cpu_err += [(lc[i] - l32[i]).abs() for i in range(n + 1)]
    ref_mean, cpu_mean = torch.stack(ref_err).mean().item(), torch.stack(cpu_err).mean().item()
    ref_max, cpu_max = max(e.max().item() for e in ref_err), max(e.max().item() for e in cpu_err)
    assert cpu_mean <= 1.5 * ref_mean and cpu_mean < 0.25, (cpu_mean, ref_mean)
    assert cpu_max <= 1.5 * ref_max, (cpu_max, ref_max)
