"""Fresh-prefill attention (fused SDPA) against the paged Triton kernel on the GPU, and timed:
an 8k-token prompt (32 query heads, 8 KV heads, head dim 128, bf16) within a relative error
of 1e-2; the times go to $GPU_TEST_OUT/prefill_attention.json. Run by
`bash loadtest/gpu.sh tests`.
"""

from __future__ import annotations

import torch
from gpu_record import record

from meshserve.kernels import triton_attention
from meshserve.kernels.attention import AttentionMetadata, fresh_prefill_attention, write_kv


def test_fresh_prefill_matches_paged_kernel() -> None:
    torch.manual_seed(0)
    t, hq, hkv, d, bs = 8192, 32, 8, 128, 16
    q = torch.randn(t, hq, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(t, hkv, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(t, hkv, d, device="cuda", dtype=torch.bfloat16)
    nb = t // bs
    kc = torch.zeros(nb, bs, hkv, d, device="cuda", dtype=torch.bfloat16)
    vc = torch.zeros_like(kc)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(t, device="cuda"),
        query_start_loc=torch.tensor([0, t], dtype=torch.int32, device="cuda"),
        seq_lens=torch.tensor([t], dtype=torch.int32, device="cuda"),
        block_tables=torch.arange(nb, dtype=torch.int32, device="cuda")[None],
        max_query_len=t, max_seq_len=t, query_lens_cpu=[t], seq_lens_cpu=[t])
    write_kv(k, v, kc, vc, meta.slot_mapping)
    a = fresh_prefill_attention(q, k, v, meta, d**-0.5)
    b = triton_attention.paged_attention(q, kc, vc, meta, d**-0.5)
    rel = ((a.float() - b.float()).norm() / b.float().norm()).item()
    print(f"fresh prefill vs paged kernel: relative difference {rel:.2e}")
    assert rel < 1e-2, f"fresh prefill vs paged kernel: relative difference {rel:.2e}"
    times: dict[str, float] = {}
    for name, fn in (("fused sdpa", lambda: fresh_prefill_attention(q, k, v, meta, d**-0.5)),
                     ("paged triton", lambda: triton_attention.paged_attention(
                         q, kc, vc, meta, d**-0.5))):
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            fn()
        end.record()
        torch.cuda.synchronize()
        times[name] = start.elapsed_time(end) / 10
        print(f"{name}: {times[name]:.3f} ms for {t} tokens")
    record("prefill_attention", {"tokens": t, "relative_difference": rel, "ms": times})

