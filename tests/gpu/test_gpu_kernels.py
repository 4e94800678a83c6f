"""The Triton kernels on a real GPU against the PyTorch references (the CI runs the same
cases under TRITON_INTERPRET=1 on CPU; this runs them compiled, on CUDA tensors), one test
per case. Run by `bash loadtest/gpu.sh tests` and by the parts `suite` (step `kernel_check`)
and `tp` (step `kernels`).
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

# The kernel tests' cases and checks (tests/kernel_ops/test_triton_kernels.py).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernel_ops"))
import test_triton_kernels as kt

from meshserve.kernels import (
    triton_activation,
    triton_attention,
    triton_norm,
    triton_rotary,
    triton_sampling,
)
from meshserve.kernels.activation import silu_and_mul_reference
from meshserve.kernels.attention import write_kv_reference
from meshserve.kernels.linear import linear
from meshserve.kernels.norm import fused_add_rms_norm_reference, rms_norm_reference
from meshserve.kernels.rotary import RotaryEmbedding, apply_rotary

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def cuda_step(step: kt.Step) -> kt.Step:
    meta = dataclasses.replace(step.meta, **{f: getattr(step.meta, f).cuda() for f in (
        "slot_mapping", "query_start_loc", "seq_lens", "block_tables")})
    return kt.Step(step.query.cuda(), step.key.cuda(), step.value.cuda(), step.k_cache.cuda(),
                   step.v_cache.cuda(), meta)


def attention_cases():
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for case, (ctx, q) in kt.CASES.items():
            for hq, hkv, d, bs in kt.HEADS:
                for splits in (None, 3):
                    if splits and max(q) > 1:
                        continue
                    yield f"attn {case} {dtype} hq{hq} hkv{hkv} d{d} bs{bs} s{splits}", (
                        lambda c=ctx, qq=q, a=hq, b=hkv, dd=d, s=bs, t=dtype, sp=splits:
                        kt.assert_attention_close(*kt.run_attention(
                            cuda_step(kt.make_step(c, qq, a, b, dd, s, t, seed=a + dd)),
                            num_splits=sp)))
    # A long decode at batch 1, where split-KV is chosen automatically.
    yield "attn long decode auto-split bf16", lambda: kt.assert_attention_close(
        *kt.run_attention(cuda_step(kt.make_step([5000], [1], 32, 8, 128, 16,
                                                 torch.bfloat16, seed=9))))
    yield "attn 8k prefill bf16", lambda: kt.assert_attention_close(*kt.run_attention(
        cuda_step(kt.make_step([2048, 1024], [2048, 512], 32, 8, 128, 16, torch.bfloat16))))


def elementwise_cases():
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        def norm(t=dtype):
            g = torch.Generator().manual_seed(3)
            x = (3 * torch.randn(37, 4096, generator=g)).to(t)
            w = (1 + 0.5 * torch.randn(4096, generator=g)).to(t)
            kt._assert_nearly_bitwise(triton_norm.rms_norm(x.cuda(), w.cuda(), 1e-5).cpu(),
                                      rms_norm_reference(x, w, 1e-5))
            r = (2 * torch.randn(37, 4096, generator=g)).to(t)
            out, res = triton_norm.fused_add_rms_norm(x.cuda(), r.cuda(), w.cuda(), 1e-5)
            want_out, want_res = fused_add_rms_norm_reference(x, r, w, 1e-5)
            assert torch.equal(res.cpu(), want_res)
            kt._assert_nearly_bitwise(out.cpu(), want_out)

        def silu(t=dtype):
            x = (3 * torch.randn(19, 2 * 14336, generator=torch.Generator().manual_seed(5))
                 ).to(t)
            # The kernel computes SiLU in float32 and rounds once; the reference rounds the
            # SiLU to 16 bits first, so a few outputs differ by one 16-bit ulp.
            got, want = triton_activation.silu_and_mul(x.cuda()).cpu(), silu_and_mul_reference(x)
            rtol = {torch.float32: 1e-6, torch.bfloat16: 1e-2, torch.float16: 2e-3}[t]
            torch.testing.assert_close(got, want, rtol=rtol, atol=rtol)
            if t != torch.float32:  # 16-bit outputs: nearly all bit for bit
                assert (got == want).float().mean() > 0.98
        def rotary(t=dtype):
            # The fused rotary + KV write against the CPU references, bit for bit.
            g = torch.Generator().manual_seed(6)
            rope = RotaryEmbedding(128, 128, max_position=8192, base=500000.0,
                                   rope_scaling=LLAMA3_SCALING).to(t)
            qkv = (2 * torch.randn(37, 48 * 128, generator=g)).to(t)
            q, k, v = (qkv[:, :4096].view(37, 32, 128), qkv[:, 4096:5120].view(37, 8, 128),
                       qkv[:, 5120:].view(37, 8, 128))
            positions = torch.randint(0, 8192, (37,), generator=g)
            slots = torch.randperm(64 * 16, generator=g)[:37]
            slots[5] = -1
            caches = [torch.randn(64, 16, 8, 128, generator=g).to(t) for _ in range(2)]
            want_q, want_k = apply_rotary(q, k, positions, rope.cos_sin_cache)
            want_caches = [c.clone() for c in caches]
            write_kv_reference(want_k, v, *want_caches, slots)
            gpu_caches = [c.cuda() for c in caches]
            got_q, got_k = triton_rotary.apply_rotary_and_write_kv(
                q.cuda(), k.cuda(), v.cuda(), positions.cuda(), rope.cos_sin_cache.cuda(),
                *gpu_caches, slots.cuda())
            assert torch.equal(got_q.cpu(), want_q) and torch.equal(got_k.cpu(), want_k)
            assert all(torch.equal(a.cpu(), b) for a, b in zip(gpu_caches, want_caches))
        yield f"rms_norm {dtype}", norm
        yield f"silu_and_mul {dtype}", silu
        yield f"rotary_and_write_kv {dtype}", rotary


def sampling_cases():
    def distribution():
        # 100,000 draws from one row over four chunks: the frequencies of the six likely
        # tokens against the softmax (chi-square, 6 degrees of freedom with the rest).
        vocab, draws = 3 * triton_sampling.BLOCK_V + 100, 100_000
        picks = [5, 4100, vocab - 1, 8192, 8191, 9]
        row = torch.full((vocab,), -12.0, device="cuda")
        row[picks] = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0], device="cuda")
        logits = row.expand(draws, -1).contiguous()
        seeds = torch.arange(draws, device="cuda", dtype=torch.int64) * 2654435761
        tokens = triton_sampling.gumbel_argmax(logits, seeds)
        probs = row.softmax(-1).double()
        ids = torch.tensor(picks, device="cuda")
        counts = torch.bincount(tokens, minlength=vocab).double()
        observed = torch.cat([counts[ids], (draws - counts[ids].sum()).view(1)])
        expected = torch.cat([probs[ids], (1 - probs[ids].sum()).view(1)]) * draws
        chi2 = float(((observed - expected) ** 2 / expected).sum())
        assert chi2 < 22.46, f"chi-square {chi2:.1f} (6 dof, p = 0.001: 22.46)"
        again = triton_sampling.gumbel_argmax(logits[1000:3000].contiguous(), seeds[1000:3000])
        assert torch.equal(again, tokens[1000:3000])  # the same seeds in another batch
    yield "gumbel_argmax distribution and seeds", distribution


def linear_cases():
    # The Llama-3.1-8B projections at decode sizes, and ragged shapes, against a float32
    # product: float32 accumulation and one rounding, so within a 16-bit ulp or two.
    shapes = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096),
              (1000, 3000), (77, 520)]
    for dtype in (torch.bfloat16, torch.float16):
        for n, k in shapes:
            for rows in (1, 2, 8):
                def check(n=n, k=k, rows=rows, t=dtype):
                    g = torch.Generator(device="cuda").manual_seed(n + rows)
                    x = torch.randn(rows, k, device="cuda", generator=g).to(t)
                    w = (torch.randn(n, k, device="cuda", generator=g) / k**0.5).to(t)
                    want = x.float() @ w.float().T
                    got = linear(x, w).float()
                    err = ((got - want).norm() / want.norm()).item()
                    assert err < 4e-3, f"relative error {err:.2e}"
                yield f"linear {dtype} {rows}x{k} @ {n}x{k}", check


CASES: list[tuple[str, Callable[[], None]]] = [
    *attention_cases(), *elementwise_cases(), *sampling_cases(), *linear_cases()]


@pytest.mark.parametrize("check", [c for _, c in CASES], ids=[n for n, _ in CASES])
def test_kernel_on_gpu(check: Callable[[], None]) -> None:
    assert triton_attention is not None
    check()
