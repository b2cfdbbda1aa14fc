"""Megatron-LM's own args Namespace for the test families, kept as data (run by hand, not by the
tests).

    # rewrites the *.json beside it
    MLM=/path/to/Megatron-LM [MLM_COMMIT=sha] python tests/data/megatron_args/capture.py

Each family's flags are those of a Megatron-LM launch script, sizes shrunk to the models that
tests/harness/megatron_core_run.py builds in megatron-core (and parallel sizes 1: the writer sets
the layout it saves at). Megatron-LM parses them with its own parse_args and validate_args and sets
padded_vocab_size as its tokenizer builder does; the Namespace is written as JSON, each value that
is not plain data tagged with its class (an enum by module, class, name and value; a torch dtype by
name; a tuple), so that the writer can build it again with the same classes, and Megatron's pickle
of it, signal.Signals and all, is what fmeg reads.

Megatron-LM needs Triton only for GPU kernels: modules that import it are stubbed while parsing, and
typing.override is given to Python 3.11; --moe-grouped-gemm's check of the GPU is answered as an
H100 would.
"""

import enum
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import subprocess
import sys
import types
import typing
from pathlib import Path

HERE = Path(__file__).parent
MLM = Path(os.environ.get("MLM", "Megatron-LM"))

# fmt: off
_MODEL = {  # sizes and features of tests/harness/megatron_core_run.py's FAMILIES, as Megatron flags
    "llama": ["--num-layers", "4", "--hidden-size", "64", "--ffn-hidden-size", "96",
              "--num-attention-heads", "4", "--group-query-attention", "--num-query-groups", "2",
              "--kv-channels", "16"],
    "gpt2": ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4"],
}
_SHORT = ["--seq-length", "32", "--max-position-embeddings", "32", "--rotary-base", "10000",
          "--init-method-std", "0.05", "--micro-batch-size", "1", "--global-batch-size", "8"]
_NULL_VOCAB = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "127",
               "--make-vocab-size-divisible-by", "128"]

# examples/llama/train_llama3_8b_h100_fp8.sh, mock-data branch, its bf16 DTYPE branch; less
# --apply-layernorm-1p (megatron-core's local spec has no zero-centred RMSNorm to compare with)
LLAMA3_8B = [
    "--use-mcore-models", *_MODEL["llama"], "--position-embedding-type", "rope",
    "--rotary-percent", "1.0", "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--swiglu",
    "--normalization", "RMSNorm", "--attention-backend", "fused",
    "--untie-embeddings-and-output-weights", "--disable-bias-linear",
    "--train-samples", "800", "--lr-decay-samples", "640", "--lr-warmup-samples", "80",
    "--lr", "0.00015", "--min-lr", "0.00001", "--decoupled-lr", "5.0e-4",
    "--decoupled-min-lr", "4.5e-5",
    "--lr-decay-style", "cosine", "--clip-grad", "1.0", "--weight-decay", "0.1",
    "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--bf16", "--grad-reduce-in-bf16",
    "--cross-entropy-loss-fusion", "--calculate-per-token-loss", "--manual-gc",
    "--empty-unused-memory-level", "1", "--exit-duration-in-mins", "235",
    "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather", "--mock-data",
    *_NULL_VOCAB, "--tiktoken-pattern", "v2", "--split", "99,1,0",
    "--no-create-attention-mask-in-dataloader", "--no-mmap-bin-files", "--num-workers", "1",
    "--log-interval", "1", "--eval-iters", "2", "--eval-interval", "100", "--save-interval", "100",
    "--log-throughput", "--ckpt-format", "torch_dist", "--distributed-timeout-minutes", "60",
    "--save", "ckpt", "--load", "ckpt", "--tensorboard-dir", "tb", *_SHORT]
# examples/mixtral/train_mixtral_8x7b_distributed.sh, with Qwen3-MoE's q/k norms, sigmoid router
# with expert bias and shared expert (the family megatron_core_run builds)
QWEN3_MOE = [
    "--use-mcore-models", "--disable-bias-linear", *_MODEL["llama"], "--attention-dropout", "0.0",
    "--hidden-dropout", "0.0", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
    "--swiglu", "--untie-embeddings-and-output-weights", "--no-masked-softmax-fusion",
    "--no-position-embedding", "--num-experts", "4", "--moe-router-topk", "2",
    "--moe-router-load-balancing-type", "aux_loss", "--moe-aux-loss-coeff", "1e-2",
    "--moe-grouped-gemm", "--moe-token-dispatcher-type", "alltoall", "--overlap-param-gather",
    "--overlap-grad-reduce", "--moe-ffn-hidden-size", "32",
    "--moe-shared-expert-intermediate-size", "48", "--moe-router-score-function", "sigmoid",
    "--moe-router-enable-expert-bias", "--qk-layernorm", *_NULL_VOCAB, "--mock-data",
    "--split", "99990,8,2", "--lr", "1e-4", "--train-iters", "100", "--lr-decay-iters", "80",
    "--lr-decay-style", "cosine", "--min-lr", "1.0e-5", "--weight-decay", "0.1",
    "--lr-warmup-iters", "5", "--clip-grad", "1.0", "--bf16", "--use-distributed-optimizer",
    "--log-interval", "1", "--save-interval", "100", "--eval-interval", "100", "--eval-iters", "10",
    "--save", "ckpt", "--load", "ckpt", "--tensorboard-dir", "tb", "--no-load-optim",
    "--no-load-rng", *_SHORT]
# examples/gpt3/train_gpt3_175b_distributed.sh (GPT-2's BPE files as the tokenizer, its fp16),
# with --no-bias-gelu-fusion and no dropout, as megatron_core_run's model runs: erf GELU, no dropout
GPT3_175B = [
    *_MODEL["gpt2"], "--no-bias-gelu-fusion", "--hidden-dropout", "0.0",
    "--attention-dropout", "0.0",
    "--attention-backend", "auto", "--train-iters", "100", "--weight-decay", "0.1",
    "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--clip-grad", "1.0", "--fp16", "--lr", "6.0e-5",
    "--lr-decay-style", "cosine", "--min-lr", "6.0e-6", "--lr-warmup-fraction", ".001",
    "--lr-decay-iters", "80", "--mock-data", *_NULL_VOCAB, "--split", "949,50,1",
    "--log-interval", "100", "--save-interval", "100", "--eval-interval", "100", "--save", "ckpt",
    "--load", "ckpt", "--eval-iters", "10", "--tensorboard-dir", "tb", *_SHORT,
    "--ffn-hidden-size", "256"]
# the GPT-3 script with experts at Megatron's default --add-bias-linear
GPT2_MOE = [*GPT3_175B, "--num-experts", "4", "--moe-router-topk", "2",
            "--moe-ffn-hidden-size", "64"]
FAMILIES = {"llama": ("examples/llama/train_llama3_8b_h100_fp8.sh", LLAMA3_8B),
            "qwen3_moe": ("examples/mixtral/train_mixtral_8x7b_distributed.sh", QWEN3_MOE),
            "gpt2": ("examples/gpt3/train_gpt3_175b_distributed.sh", GPT3_175B),
            "gpt2_moe": ("examples/gpt3/train_gpt3_175b_distributed.sh", GPT2_MOE)}
# fmt: on


class _Dummy:
    def __init__(self, *a, **k):
        pass

    def __call__(self, *a, **k):
        return a[0] if len(a) == 1 and callable(a[0]) and not k else _Dummy()

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Dummy()


class _Stub(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Dummy


class _WithoutTriton(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Megatron's modules that use Triton kernels load as stubs: parsing flags runs none of them."""

    def find_spec(self, name, path, target=None):
        if not name.startswith("megatron."):
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or not (spec.origin or "").endswith(".py"):
            return None
        source = Path(spec.origin).read_text()
        if "import triton" in source or ("triton" in source and "/ops/" in spec.origin):
            return importlib.util.spec_from_loader(
                name, self, is_package=bool(spec.submodule_search_locations)
            )
        return None

    def create_module(self, spec):
        module = _Stub(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


def encoded(value):
    """A Namespace value as JSON, tagged where JSON alone would lose its class."""
    import torch

    if (
        value is None
        or isinstance(value, (bool, int, float, str))
        and not isinstance(value, enum.Enum)
    ):
        return value
    if isinstance(value, enum.Enum):
        cls = type(value)
        return {
            "enum": f"{cls.__module__}:{cls.__qualname__}",
            "name": value.name,
            "value": encoded(value.value),
        }
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    if isinstance(value, tuple):
        return {"tuple": [encoded(v) for v in value]}
    if isinstance(value, list):
        return [encoded(v) for v in value]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {"dict": {k: encoded(v) for k, v in value.items()}}
    raise TypeError(
        f"no JSON form for {type(value).__module__}.{type(value).__qualname__}: {value!r}"
    )


def megatron_args(argv: list[str]):
    from megatron.training.arguments import parse_args, validate_args
    from megatron.core.tokenizers.utils.build_tokenizer import vocab_size_with_padding

    import torch

    torch.cuda.get_device_capability = lambda *_: (9, 0)  # --moe-grouped-gemm asks for an H100's
    sys.argv = ["pretrain_gpt.py", *argv]
    args = parse_args()
    validate_args(args)
    args.padded_vocab_size = vocab_size_with_padding(
        args.vocab_size + 1, args, logging_enabled=False
    )
    return args


def main() -> None:
    sys.path.insert(0, str(MLM))
    typing.override = getattr(typing, "override", lambda f: f)
    sys.meta_path.insert(0, _WithoutTriton())
    os.environ.update(WORLD_SIZE="1", RANK="0", LOCAL_RANK="0")
    commit = (
        os.environ.get("MLM_COMMIT")
        or subprocess.run(
            ["git", "-C", str(MLM), "rev-parse", "HEAD"], capture_output=True, text=True
        ).stdout
    )
    for family, (script, argv) in FAMILIES.items():
        args = megatron_args(argv)
        record = {
            "megatron_lm": commit.strip() or "unknown",
            "script": script,
            "argv": argv,
            "args": {k: encoded(v) for k, v in sorted(vars(args).items())},
        }
        (HERE / f"{family}.json").write_text(json.dumps(record, indent=0) + "\n")
        print(family, len(record["args"]), "dests")


if __name__ == "__main__":
    main()
