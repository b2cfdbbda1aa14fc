"""CUDA and NCCL: the runner on cuda:LOCAL_RANK follows the CPU loss curve (fp32). Skipped without a GPU
(CI has none); run on a machine with one: python -m pytest tests/test_cuda.py"""

import pytest
import torch

from fmeg.training.session import choose_device
from runner_harness import run_layout

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
    got = run_layout(tmp_path, "cuda_bf16", 1, ["--device", "cuda", "--bf16", "--use-distributed-optimizer",
                                                 "--overlap-grad-reduce"])
    close(got, reference["plain"], 2e-2)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs two GPUs")
@pytest.mark.parametrize("flags", [["--tensor-model-parallel-size", "2", "--sequence-parallel"],
                                   ["--pipeline-model-parallel-size", "2"],
                                   ["--use-distributed-optimizer", "--overlap-grad-reduce",
                                    "--ddp-bucket-size", "3000"]])
def test_two_gpus_over_nccl_follow_the_cpu_curve(tmp_path, reference, flags):
    close(run_layout(tmp_path, "nccl", 2, ["--device", "cuda", *flags]), reference["plain"], 1e-4)
