"""What import-hf prints: one short line naming the model (not GPTConfig's repr), and nothing of
torchao's import on stderr (transformers imports torchao, the test extra, as it builds a model; its
import logs kernels it cannot load and two torch deprecations, fmeg.interop.quiet_torchao)."""

import logging
import subprocess
import sys

import pytest

from harness.hf_models import tiny_llama

# what torchao's import wrote to stderr before fmeg.interop silenced it
TORCHAO_LINES = ("Failed to load", "_C_mxfp8", "_C_cutlass", "register_constant")


def test_import_hf_prints_one_short_line_and_nothing_of_torchao(tmp_path):
    pytest.importorskip("transformers")
    tiny_llama(tmp_path / "hf")
    out = subprocess.run(
        [sys.executable, "-m", "recipes.convert_checkpoint", "import-hf"]
        + ["--input", str(tmp_path / "hf"), "--save", str(tmp_path / "ck")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert not [line for line in out.stderr.splitlines() if any(t in line for t in TORCHAO_LINES)]
    assert out.stdout == (
        f"wrote {tmp_path / 'ck' / 'iter_0000000'} from {tmp_path / 'hf'}: llama: 2 layers, "
        "hidden 16, 4 heads (2 kv), vocab 64\n"
    )


def test_the_summary_names_experts_and_mtp_depths():
    from fmeg.models.gpt import GPTConfig
    from recipes.convert_checkpoint import model_summary

    config = GPTConfig.llama(
        num_layers=1, hidden_size=64, num_heads=4, num_kv_heads=2, num_experts=8, moe_router_topk=2
    )
    assert model_summary(config, "mixtral") == (
        "mixtral: 1 layer, hidden 64, 4 heads (2 kv), vocab 32000, 8 experts (top 2)"
    )
    assert model_summary(config.replace(mtp_num_layers=1), "deepseek_v3").endswith(
        ", 8 experts (top 2), 1 MTP depth"
    )


def _record(name: str, message: str, *args) -> logging.LogRecord:
    return logging.LogRecord(name, logging.WARNING, __file__, 1, message, args, None)


def test_only_torchaos_import_lines_are_dropped():
    from fmeg.interop import quiet_torchao

    quiet_torchao()
    quiet_torchao()
    torchao, pytree = logging.getLogger("torchao"), logging.getLogger("torch.utils._pytree")
    assert len(torchao.filters) == len(pytree.filters) == 1
    so = "/site-packages/torchao/_C_mxfp8.cpython-310-x86_64-linux-gnu.so"
    assert not torchao.filter(_record("torchao", f"Failed to load {so}: Could not load {so}"))
    assert torchao.filter(_record("torchao", "Skipping import of cpp extensions"))

    class KernelPreference:
        __module__ = "torchao.quantization.quantize_.common.kernel_preference"

    class Mine:
        __module__ = "mine"

    deprecated = (
        "%s is an Enum subclass and is now natively supported by torch.compile as an opaque value "
        "type. Calling register_constant() on Enum subclasses is deprecated and will be an error "
        "in a future release."
    )
    assert not pytree.filter(_record("torch.utils._pytree", deprecated, KernelPreference))
    assert pytree.filter(_record("torch.utils._pytree", deprecated, Mine))
    assert pytree.filter(_record("torch.utils._pytree", "another warning"))
