"""CUDA and NCCL: the runner on cuda:LOCAL_RANK follows the CPU loss curve (fp32). Skipped without a
GPU (CI has none); run on a machine with one: python -m pytest tests/test_cuda.py"""

import pytest
import torch

from fmeg.training.session import choose_device
from harness.runner import run_layout

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


def test_device_choice_follows_the_flag_and_local_rank():
    assert choose_device("cpu", 3) == torch.device("cpu")
    assert choose_device("cuda", 3) == torch.device("cuda", 3)
    want = torch.device("cuda", 1) if torch.cuda.is_available() else torch.device("cpu")
    assert choose_device("auto", 1) == want


def close(got, want, rtol):
    assert len(got) == len(want) == 20
    for a, b in zip(got, want):
        assert abs(a - b) <= rtol * abs(b), (got, want)


@needs_gpu
def test_one_gpu_follows_the_cpu_curve(tmp_path, reference):
    close(run_layout(tmp_path, "cuda", 1, ["--device", "cuda"]), reference["plain"], 1e-4)


@needs_gpu
def test_one_gpu_bf16_and_zero_overlap_run(tmp_path, reference):
    got = run_layout(
        tmp_path,
        "cuda_bf16",
        1,
        ["--device", "cuda", "--bf16", "--use-distributed-optimizer", "--overlap-grad-reduce"],
    )
    close(got, reference["plain"], 2e-2)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs two GPUs")
@pytest.mark.parametrize(
    "flags",
    [
        ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
        ["--pipeline-model-parallel-size", "2"],
        ["--use-distributed-optimizer", "--overlap-grad-reduce", "--ddp-bucket-size", "3000"],
        ["--context-parallel-size", "2"],  # the ring over NCCL, compiled (the default)
        ["--context-parallel-size", "2", "--cp-comm-type", "a2a"],
    ],
)
def test_two_gpus_over_nccl_follow_the_cpu_curve(tmp_path, reference, flags):
    close(run_layout(tmp_path, "nccl", 2, ["--device", "cuda", *flags]), reference["plain"], 1e-4)


@needs_gpu
@pytest.mark.parametrize("comm_type", ["p2p", "all_gather", "a2a"])
@pytest.mark.parametrize(
    "dtype, seq, tol",
    [(torch.float32, 64, 1e-4), (torch.float32, 80, 1e-4), (torch.bfloat16, 80, 3e-2)],
)
def test_context_parallel_attention_on_cuda_equals_one_device(comm_type, dtype, seq, tol):
    """The attention blocks on CUDA (the memory-efficient kernel, ranks as threads): this rank's
    rows and gradients of one device's attention; at seq 80 the blocks have 20 and 40 rows, not the
    multiple of 32 the kernel's lse is padded to."""
    from harness import spmd_programs as P
    from fmeg import ops
    from fmeg.parallel import context
    from fmeg.parallel.spmd import run_threads

    gen = torch.Generator(device="cuda").manual_seed(0)
    q, dout = (torch.randn(2, 4, seq, 16, device="cuda", generator=gen).to(dtype) for _ in range(2))
    k, v = (torch.randn(2, 2, seq, 16, device="cuda", generator=gen).to(dtype) for _ in range(2))
    want, vjp = torch.func.vjp(ops.causal_attention, *(t.float() for t in (q, k, v)))
    grads = vjp(dout.float())
    for r, got in enumerate(
        run_threads(2, P.context_attention, q, k, v, dout, comm_type, 0.0, tp=1, cp=2)
    ):
        mine = lambda t: t.index_select(-2, context.positions(seq, 2, r, "cuda"))  # noqa: E731
        torch.testing.assert_close(got["out"].float(), mine(want), rtol=tol, atol=tol)
        for g, w in zip(got["grads"], grads):
            torch.testing.assert_close(g.float(), mine(w), rtol=tol, atol=tol)


@needs_gpu
@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise", "mxfp8"])
def test_fp8_linear_on_cuda_equals_the_cpu_one(recipe):
    """The FP8 linear on CUDA (tensor-wise through torch._scaled_mm on the tensor cores) against
    the same function on the CPU: the same FP8 numbers, so forward and gradients within fp32
    rounding."""
    from fmeg.fp8 import Fp8Gemms, Fp8Recipe, fp8_linear

    gen = torch.Generator().manual_seed(0)
    x, w, g = (torch.randn(*s, generator=gen) for s in ((256, 512), (384, 512), (256, 384)))
    gemms = Fp8Gemms(Fp8Recipe("hybrid", recipe))
    out = []
    for device in ("cpu", "cuda"):
        xs, ws = (t.detach().to(device).requires_grad_() for t in (x, w))
        y = fp8_linear(xs, ws, None, gemms)
        y.backward(g.to(device))
        out.append([t.detach().cpu() for t in (y, xs.grad, ws.grad)])
    for a, b in zip(*out):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5 * a.abs().max().item())


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_experts_on_cuda_equal_the_cpu_ones(dtype):
    """The experts' FP8 grouped GEMMs (per (expert, microbatch) row scales, dequantized operands
    multiplied in fp32) on CUDA against the CPU: forward and gradients within fp32 rounding."""
    from fmeg.fp8 import Fp8Experts, Fp8Recipe, fp8_grouped_linear

    gen = torch.Generator().manual_seed(0)
    expert = torch.randint(0, 4, (512,), generator=gen).sort().values
    source = torch.randint(0, 2, (512,), generator=gen)
    counts = torch.bincount(expert, minlength=4)
    x, w, g = (torch.randn(*s, generator=gen) for s in ((512, 256), (4, 384, 256), (512, 384)))
    spec = Fp8Experts(Fp8Recipe("hybrid", "tensorwise"), sources=2)
    out = []
    for device in ("cpu", "cuda"):
        xs, ws = (t.to(device, dtype).requires_grad_() for t in (x, w))
        moved = (t.to(device) for t in (counts, expert, source))
        y = fp8_grouped_linear(xs, ws, *moved, spec)
        y.backward(g.to(device, dtype))
        out.append([t.detach().float().cpu() for t in (y, xs.grad, ws.grad)])
    for a, b in zip(*out):
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(b, a, rtol=tol, atol=tol * a.abs().max().item())
