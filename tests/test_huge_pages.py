"""The KV cache on 2 MB pages (servelab_kernels.huge_pages): the THP mode read from sysfs, the advice
taken where the kernel gives huge pages, and `attention.huge_pages=false` keeping plain pages."""

import torch

from core.api import KVCacheSpec
from plugins.attention.cpu_attn import CPUAttention, CPUAttentionConfig
from servelab_kernels import huge_pages
from servelab_kernels.attention import allocate_kv_layer

MB = 1 << 20


def test_the_thp_mode_is_the_bracketed_word(tmp_path, monkeypatch):
    entry = tmp_path / "enabled"
    entry.write_text("always [madvise] never\n")
    monkeypatch.setattr(huge_pages, "THP_ENABLED", entry)
    assert huge_pages.mode() == "madvise"
    entry.write_text("[always] madvise never\n")
    assert huge_pages.mode() == "always"
    entry.write_text("always madvise [never]\n")
    assert huge_pages.mode() == "never"
    # THP off: nothing to ask for, so no mapping of ours is made (whether the allocator's memory sits in a
    # mapping advised earlier depends on what ran before in the process: the suite once saw it "hg")
    mapped = []
    monkeypatch.setattr(huge_pages.mmap, "mmap", lambda *a, **k: mapped.append(a))
    assert huge_pages._anonymous(4 * MB) is None
    t = huge_pages.zeros((4 * MB,), torch.uint8)
    assert mapped == [] and t.shape == (4 * MB,) and int(t.count_nonzero()) == 0
    monkeypatch.setattr(huge_pages, "THP_ENABLED", tmp_path / "missing")
    assert huge_pages.mode() == "unavailable"


def test_zeros_are_zeros_on_huge_pages_where_the_kernel_gives_them(monkeypatch):
    t = huge_pages.zeros((32 * MB // 2,), torch.bfloat16)
    assert t.dtype == torch.bfloat16 and t.shape == (16 * MB,) and int(t.count_nonzero()) == 0
    mapped = []
    real = huge_pages._anonymous
    monkeypatch.setattr(huge_pages, "_anonymous", lambda n: mapped.append(n) or real(n))
    with huge_pages.enabled(False):
        plain = huge_pages.zeros((32 * MB // 2,), torch.bfloat16)
    assert int(plain.count_nonzero()) == 0
    # switched off, no advised mapping of ours is made (the allocator's memory may still be on huge
    # pages, or share a mapping advised before: glibc reuses its heap, so advised(plain) depends on
    # what ran earlier in the process)
    assert mapped == []
    if huge_pages.mode() in ("always", "madvise"):
        assert huge_pages.advised(t)
        assert huge_pages.huge_bytes(t) >= 2 * MB  # at least one 2 MB page (compaction may not find them all)
    else:
        assert not huge_pages.advised(t)


def test_the_cpu_backend_s_kv_cache_follows_attention_huge_pages():
    spec = KVCacheSpec(num_layers=2, num_kv_heads=3, head_dim=64, dtype=torch.bfloat16, max_model_len=256)
    blocks = 8 * MB // (3 * 16 * 64 * 2)  # 8 MB a tensor
    on = CPUAttention(CPUAttentionConfig(name="cpu"), "cpu").allocate_kv_cache(blocks, 16, spec, "cpu")
    off = CPUAttention(CPUAttentionConfig(name="cpu", huge_pages=False), "cpu").allocate_kv_cache(blocks, 16, spec, "cpu")
    assert len(on) == len(off) == 2 and all(int(t.count_nonzero()) == 0 for layer in on + off for t in layer)
    assert on[0][0].shape == allocate_kv_layer(blocks, 3, 16, 64, torch.bfloat16)[0].shape == (blocks, 3, 16, 64)
    # (off: torch.zeros, whose memory may sit in a mapping advised earlier in the process)
    if huge_pages.mode() in ("always", "madvise"):
        assert all(huge_pages.advised(t) for layer in on for t in layer)
        assert min(huge_pages.huge_bytes(t) for layer in on for t in layer) >= 2 * MB
