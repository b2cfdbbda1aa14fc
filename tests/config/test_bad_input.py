"""Every command refuses bad input the same way: a non-zero exit (2), exactly one `error:` line
naming the flag, file or field, no traceback, and no file left behind. One process each, in this
process; the same cases on several ranks through the launcher are in test_launch.py (slow).

Cases: every float flag of the runner given nan and inf, every integer flag given a word, every
choice flag given a value it does not take, prefixes and misspellings, and the commands' own
rules."""

from __future__ import annotations


import pytest
import torch

from fmeg.config.arguments import build_parser
from harness.bad_input import T, assert_one_line_exit_2_nothing_left


def runner_cases() -> list[tuple[list[str], str]]:
    cases = []
    for action in build_parser()._actions:
        if not action.option_strings or not action.option_strings[0].startswith("--"):
            continue
        flag = action.option_strings[0]
        if action.type is float:
            cases += [
                ([flag, "nan"], f"{flag} must be a finite number, got nan"),
                ([flag, "inf"], f"{flag} must be a finite number, got inf"),
            ]
        elif action.type is int and action.nargs is None:
            cases.append(([flag, "many"], f"argument {flag}: invalid int value: 'many'"))
        if action.choices is not None and action.nargs is None:
            cases.append(([flag, "bogus"], f"argument {flag}: invalid choice: 'bogus'"))
    return cases + [
        (
            ["--loss-scale-win", "8"],
            "unrecognized argument --loss-scale-win (did you mean --loss-scale-window?)",
        ),
        (["--tensor-model-parallel", "2"], "unrecognized argument --tensor-model-parallel"),
        (["--lr-decay"], "unrecognized argument --lr-decay"),
        (
            ["--hiden-size", "64"],
            "unrecognized argument --hiden-size (did you mean --hidden-size?)",
        ),
        (["--rampup-batch-size", "4", "4"], "argument --rampup-batch-size: expected 3 arguments"),
        (["--config", f"{T}/none.yaml"], "--config"),
        (["--data-path", f"{T}/missing"], "--data-path"),
        # fine: a directory without a checkpoint starts afresh (not a case)
        (["--load", f"{T}"], None),
        (
            ["--tokenizer-type", "NullTokenizer"],
            "--tokenizer-type NullTokenizer needs a --vocab-size",
        ),
        (["--tokenizer-type", "NullTokenizer", "--vocab-size", "1"], "--vocab-size of at least 2"),
        (
            ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", f"{T}/none.json"],
            "none.json",
        ),
        (
            ["--step-batch-size-schedule", "0:3", "--micro-batch-size", "2"],
            "--step-batch-size-schedule",
        ),
        (
            ["--step-batch-size-schedule", "10M:8"],
            "--step-batch-size-schedule: the first threshold must be 0",
        ),
        (
            ["--step-batch-size-schedule", ""],
            "--step-batch-size-schedule: no THRESHOLD:BATCH_SIZE entries",
        ),
        (
            ["--step-batch-size-schedule", "0:4", "--rampup-batch-size", "4", "4", "8"],
            "--step-batch-size-schedule and --rampup-batch-size are alternatives",
        ),
        (["--loss-scale", "0", "--fp16"], "--loss-scale must be positive"),
        (["--exit-signal", "SIGKILL"], "argument --exit-signal: invalid choice: 'SIGKILL'"),
        (["--wandb-project"], "argument --wandb-project: expected one argument"),
        (["--keep-last", "0"], "--keep-last must be positive"),
        (["--seed", str(2**64)], "--seed must be in [0, 2**63)"),
        (["--eval-interval", "0"], "--eval-interval must be positive"),
        # mixtures of experts: Megatron's rules, and what fmeg does not have yet
        (
            ["--num-experts", "4", "--moe-router-topk", "5"],
            "--moe-router-topk 5 must be in [1, --num-experts 4]",
        ),
        (
            ["--num-experts", "4", "--expert-model-parallel-size", "2"],
            "--expert-model-parallel-size 2 x expert tensor parallelism 1 must divide tp x dp x "
            "cp = 1 x 1 x 1",
        ),
        (
            ["--expert-model-parallel-size", "2"],
            "--expert-model-parallel-size 2 needs --num-experts",
        ),
        (
            ["--num-experts", "4", "--moe-layer-freq", "([0]+[1]*2)"],
            "--moe-layer-freq: the pattern has 3 entries",
        ),
        (
            ["--num-experts", "4", "--moe-layer-freq", "__import__('os')"],
            "argument --moe-layer-freq",
        ),
        (
            ["--num-experts", "4", "--moe-router-num-groups", "3", "--moe-router-group-topk", "1"],
            "--moe-router-num-groups 3 must divide --num-experts 4",
        ),
        (
            ["--num-experts", "4", "--moe-router-num-groups", "2"],
            "--moe-router-num-groups and --moe-router-group-topk",
        ),
        (
            ["--num-experts", "4", "--moe-router-enable-expert-bias"],
            "--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid",
        ),
        (
            ["--num-experts", "4", "--moe-pad-expert-input-to-capacity"],
            "--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor",
        ),
        (
            ["--num-experts", "4", "--moe-router-load-balancing-type", "sinkhorn"],
            "--moe-router-load-balancing-type sinkhorn: not supported by fmeg yet",
        ),
        (
            ["--num-experts", "4", "--expert-tensor-parallel-size", "3"],
            "--expert-tensor-parallel-size 3",
        ),
        (
            ["--multi-latent-attention"],
            "--multi-latent-attention rotates its own rotary part: use --position-embedding-type "
            "rope, not learned_absolute",
        ),
        (
            [
                "--multi-latent-attention",
                "--position-embedding-type",
                "rope",
                "--qk-pos-emb-head-dim",
                "7",
            ],
            "--qk-pos-emb-head-dim 7 must be even",
        ),
        (
            [
                "--multi-latent-attention",
                "--position-embedding-type",
                "rope",
                "--v-head-dim",
                "256",
            ],
            "--v-head-dim 256 must not exceed --qk-head-dim + --qk-pos-emb-head-dim (192)",
        ),
        (
            [
                "--multi-latent-attention",
                "--position-embedding-type",
                "rope",
                "--kv-lora-rank",
                "0",
            ],
            "--kv-lora-rank must be positive, got 0",
        ),
        (["--mtp-num-layers", "1"], "--mtp-num-layers needs --position-embedding-type rope"),
        (
            ["--mtp-num-layers", "-1", "--position-embedding-type", "rope"],
            "--mtp-num-layers must be positive, got -1",
        ),
        (
            ["--window-size", "4,2"],
            "--window-size 4,2: a causal model's window looks back only; use LEFT,0",
        ),
        (["--window-size", "four"], "argument --window-size: not a window such as 128,0"),
        (
            ["--window-size", "4,0", "--window-attn-skip-freq", "[1,0]"],
            "--window-attn-skip-freq gives 2 layers for --num-layers 4",
        ),
        (
            ["--glu-linear-offset", "1.0"],
            "--glu-linear-offset and --activation-func-clamp-value act on gated MLPs",
        ),
        (
            ["--quick-geglu", "--activation-func-clamp-value", "0"],
            "--activation-func-clamp-value must be positive",
        ),
        (
            ["--quick-geglu", "--swiglu"],
            "--quick-geglu, --swiglu and --squared-relu are alternatives",
        ),
        (
            ["--yarn-original-max-position-embeddings", "4096"],
            "--yarn-original-max-position-embeddings sets YaRN's values for --enable-gpt-oss or "
            "--multi-latent-attention: add one",
        ),
        (
            ["--recompute-modules", "mlp"],
            "--recompute-modules applies to --recompute-granularity selective",
        ),
        (
            ["--exp-avg-dtype", "bf16"],
            "--exp-avg-dtype bf16 acts with --use-precision-aware-optimizer",
        ),
        (
            ["--use-precision-aware-optimizer", "--exp-avg-sq-dtype", "fp8"],
            "--exp-avg-sq-dtype fp8: moments in fp16 or fp8 need Megatron's scaling",
        ),
        (
            ["--use-precision-aware-optimizer", "--main-grads-dtype", "bf16"],
            "--main-grads-dtype bf16: fmeg keeps fp32 main weights and gradients",
        ),
        (
            ["--recompute-activations", "--recompute-modules", "mla_up_proj"],
            "--recompute-modules mla_up_proj recomputes multi-latent attention's up-projections",
        ),
        (
            ["--recompute-activations", "--recompute-modules", "attn"],
            "--recompute-modules: invalid choice",
        ),
        (
            ["--multi-latent-attention", "--position-embedding-type", "rope", "--yarn-mscale", "1"],
            "--yarn-mscale: multi-latent attention's YaRN takes --rotary-scaling-factor",
        ),
        (
            [
                "--multi-latent-attention",
                "--position-embedding-type",
                "rope",
                "--softmax-type",
                "learnable",
            ],
            "are for standard attention, not --multi-latent-attention",
        ),
        (["--context-parallel-size", "0"], "--context-parallel-size must be positive, got 0"),
        (
            ["--cp-comm-type", "a2a+p2p"],
            "--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes",
        ),
        (
            ["--hierarchical-context-parallel-sizes", "2", "2"],
            "whose product is --context-parallel-size 1",
        ),
        (["--cp-comm-type", "p2p", "a2a"], "--cp-comm-type: 2 values for --num-layers 4"),
        (["--cp-comm-type", "ring"], "argument --cp-comm-type: invalid choice"),
        (["--moe-shared-expert-gate"], "--moe-shared-expert-gate needs --num-experts"),
        (
            ["--rotary-interleaved"],
            "--rotary-interleaved: interleaved rotary embeddings (Llama 4's) is not supported",
        ),
        (
            ["--is-hybrid-model"],
            "--is-hybrid-model: hybrid Mamba models (Nemotron-H) is not supported by fmeg yet",
        ),
        # Megatron's post-training (ModelOpt) flags that ask for what fmeg lacks
        (
            ["--export-quant-cfg", "fp8"],
            "--export-quant-cfg fp8: quantization (ModelOpt's recipes) is not supported",
        ),
        (
            ["--export-real-quant-cfg", "fp8_real_quant"],
            "--export-real-quant-cfg fp8_real_quant: quantized weights",
        ),
        (
            ["--export-kv-cache-quant", "fp8"],
            "--export-kv-cache-quant fp8: KV-cache quantization is not supported",
        ),
        (
            ["--export-kd-teacher-load", f"{T}/teacher"],
            "knowledge distillation is not supported by fmeg yet",
        ),
        (
            ["--export-offline-model"],
            "--export-offline-model: offline speculative-decoding training",
        ),
        (["--export-qk-l2-norm"], "--export-qk-l2-norm: Llama 4's L2-normalised queries and keys"),
        (
            ["--export-moe-apply-probs-on-input"],
            "--export-moe-apply-probs-on-input: Llama 4's expert scaling",
        ),
        (
            ["--export-model-type", "MambaModel"],
            "--export-model-type MambaModel: Mamba models are not supported",
        ),
        (
            ["--finetune-hf-dataset", "Magpie-Align/Magpie-Llama-3.1-Pro-MT-300K-Filtered"],
            "reads no Hugging Face Hub dataset (no download inside a run); write its "
            "conversations as JSONL",
        ),
        # the audit of issue 49: a hang, depths without targets, flags that would change nothing
        (
            ["--pipeline-model-parallel-layout", "(t|)*999999999"],
            "writes out more than 100000 symbols",
        ),
        (
            ["--mtp-num-layers", "40", "--seq-length", "32", "--position-embedding-type", "rope"],
            "--mtp-num-layers 40: depths from 32 on would have no target in a --seq-length 32 "
            "sample",
        ),
        (
            ["--kv-lora-rank", "16"],
            "--kv-lora-rank applies to --multi-latent-attention, which is not given",
        ),
        (["--fim-rate", "0.2"], "--fim-rate applies to --fim-data, which is not given"),
        (
            ["--window-attn-skip-freq", "2"],
            "--window-attn-skip-freq applies to --window-size, which is not given",
        ),
        (
            ["--recompute-granularity", "selective", "--recompute-modules", "moe"],
            "--recompute-modules moe recomputes the experts, and the model has none",
        ),
        (
            ["--num-layers", "4", "--num-virtual-stages-per-pipeline-rank", "3"],
            "--num-virtual-stages-per-pipeline-rank 3 must divide the 4 decoder layers of each "
            "pipeline rank",
        ),
        (
            ["--pipeline-schedule", "zero_bubble_v"],
            "--pipeline-schedule zero_bubble_v places two stages on each pipeline rank in a V: it "
            "needs --pipeline-model-parallel-size > 1",
        ),
        (
            ["--global-batch-size", "8", "--eval-global-batch-size", "7"],
            "--eval-global-batch-size 7: a validation batch other than the final global batch (8)",
        ),
        (
            ["--optimizer", "muon", "--muon-coefficient-type", "septic"],
            "--muon-coefficient-type septic: expected one of",
        ),
        (["--optimizer", "muon", "--muon-num-ns-steps", "0"], "--muon-num-ns-steps must be"),
        (["--optimizer", "sgd", "--sgd-momentum", "1.5"], "--sgd-momentum"),
        (
            ["--optimizer", "muon", "--muon-scalar-optimizer", "lion", "--lion-beta2", "-0.1"],
            "--lion-beta2",
        ),
        (
            ["--optimizer", "muon", "--muon-coefficient-type", "cubic5"]
            + ["--muon-num-ns-steps", "4"],
            "--muon-coefficient-type cubic5 is a fixed 5-step schedule",
        ),
        # the audit of issue 67: flags another optimizer or FP8 reads, FP8 scales out of range,
        # messages without their subject
        (
            ["--sgd-momentum", "0.5"],
            "--sgd-momentum is read by --optimizer sgd, and this run's --optimizer is adam",
        ),
        (
            ["--muon-num-ns-steps", "3"],
            "--muon-num-ns-steps is read by --optimizer muon / dist_muon / adaptive_muon, and "
            "this run's --optimizer is adam",
        ),
        (
            ["--optimizer", "muon", "--lion-beta1", "0.9"],
            "--lion-beta1 is read by --muon-scalar-optimizer lion, and this run's Muon steps the "
            "other leaves with adam",
        ),
        (
            ["--fp8-recipe", "tensorwise"],
            "--fp8-recipe tensorwise applies to --fp8-format, which is not given",
        ),
        (
            ["--fp8-format", "hybrid", "--fp8-margin", "-200"],
            "--fp8-margin -200: delayed scaling's scale fp8_max / amax / 2^margin leaves fp32's "
            "range",
        ),
        (
            ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise", "--first-last-layers-bf16"]
            + ["--num-layers", "2", "--num-layers-at-start-in-bf16", "5"],
            "--num-layers-at-start-in-bf16 5 + --num-layers-at-end-in-bf16 1 keep all "
            "--num-layers 2 in BF16: no layer would run FP8",
        ),
        (
            ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"]
            + ["--num-layers-at-end-in-bf16", "2"],
            "--num-layers-at-end-in-bf16 applies to --first-last-layers-bf16, which is not given",
        ),
        (
            ["--decoder-first-pipeline-num-layers", "0"],
            "--decoder-first-pipeline-num-layers 0: an uneven first or last stage needs "
            "--pipeline-model-parallel-size > 1",
        ),
    ]


def recipe_cases() -> list[tuple[str, list[str], str]]:
    load = ["--load", f"{T}/ck"]
    out = [
        ("generate", ["--load", f"{T}/none", "--prompt", "x"], "--load"),
        (
            "generate",
            [*load, "--prompt", "x", "--temperature", "nan"],
            "--temperature must be a finite number",
        ),
        ("generate", [*load, "--prompt", "x", "--top-p", "inf"], "--top-p must be a finite number"),
        ("generate", [*load, "--prompt", "x", "--top-p", "2"], "--top-p must be at most 1"),
        ("generate", [*load, "--prompt", "x", "--top-k", "-1"], "--top-k must be >= 0"),
        (
            "generate",
            [*load, "--prompt", "x", "--seed", str(2**64)],
            "--seed must be an integer from 0",
        ),
        ("generate", [*load, "--prompt", "x", "--tokens", "-2"], "--tokens must be >= 0"),
        (
            "generate",
            [*load, "--prompt", "x", "--tokens", "ten"],
            "argument --tokens: invalid int value",
        ),
        (
            "generate",
            [*load, "--prompt", "x", "--bf16", "--fp16"],
            "--bf16 and --fp16 exclude each other",
        ),
        (
            "generate",
            [*load, "--prompt", "x", "--distributed-timeout-minutes", "0"],
            "--distributed-timeout-minutes must be a positive number",
        ),
        (
            "serve",
            [*load, "--distributed-timeout-minutes", "nan"],
            "--distributed-timeout-minutes must be a positive",
        ),
        (
            "generate",
            [*load, "--prompt", "x", "--tensor-model-parallel-size", "0"],
            "must be positive",
        ),
        (
            "generate",
            [*load, "--prompt", "x", "--tensor-model-parallel-size", "2"],
            "world size is 1",
        ),
        ("generate", [*load, "--prompt", "x", "--promt", "y"], "unrecognized argument --promt"),
        ("generate", [*load], "the following arguments are required: --prompt"),
        (
            "generate",
            [*load, "--prompt", "x", "--device", "tpu"],
            "argument --device: invalid choice",
        ),
        (
            "generate",
            [*load, "--prompt", "x", "--tokenizer-type", "Nope"],
            "argument --tokenizer-type",
        ),
        ("serve", ["--load", f"{T}/none"], "--load"),
        ("serve", [*load, "--port", "99999"], "--port must be in [0, 65535]"),
        ("serve", [*load, "--port", "-1"], "--port must be in [0, 65535]"),
        ("serve", [*load, "--port", "http"], "argument --port: invalid int value"),
        ("serve", [*load, "--prot", "80"], "unrecognized argument --prot (did you mean --port?)"),
        ("serve", [*load, "--bf16", "--fp16"], "--bf16 and --fp16 exclude each other"),
        ("serve", [*load, "--pipeline-model-parallel-size", "3"], "world size is 1"),
        (
            "preprocess_data",
            ["--input", f"{T}/none.jsonl", "--output-prefix", f"{T}/out"],
            "--input",
        ),
        (
            "preprocess_data",
            ["--input", f"{T}/in.jsonl", "--output-prefix", f"{T}/out", "--workers", "0"],
            "--workers must be at least 1",
        ),
        (
            "preprocess_data",
            ["--input", f"{T}/in.jsonl", "--output-prefix", f"{T}/out", "--worker", "2"],
            "unrecognized argument --worker (did you mean --workers?)",
        ),
        (
            "preprocess_data",
            [
                "--input",
                f"{T}/in.jsonl",
                "--output-prefix",
                f"{T}/out",
                "--tokenizer-type",
                "NullTokenizer",
            ],
            "--vocab-size",
        ),
        (
            "preprocess_data",
            ["--input", f"{T}/in.jsonl", "--output-prefix", f"{T}/out", "--json-keys", "body"],
            "--input",
        ),
        (
            "preprocess_data",
            [
                "--input",
                f"{T}/in.jsonl",
                "--output-prefix",
                f"{T}/out",
                "--json-keys",
                "body",
                "--strict",
            ],
            "no key 'body'",
        ),
        (
            "preprocess_data",
            ["--input", f"{T}/in.jsonl", "--output-prefix", f"{T}/in.jsonl/out"],
            "--output-prefix",
        ),
        (
            "preprocess_data",
            ["--input", f"{T}/in.jsonl"],
            "the following arguments are required: --output-prefix",
        ),
        (
            "preprocess_data",
            [
                "--input",
                f"{T}/in.jsonl",
                "--output-prefix",
                f"{T}/out",
                "--tokenizer-type",
                "GPT2BPETokenizer",
            ],
            "--vocab-file",
        ),
        (
            "convert_checkpoint",
            ["consolidate", "--load", f"{T}/none", "--output", f"{T}/x.safetensors"],
            "none",
        ),
        (
            "convert_checkpoint",
            ["consolidate", "--load", f"{T}/ck", "--output", f"{T}/in.jsonl"],
            "exists; choose a new file name",
        ),
        (
            "convert_checkpoint",
            ["consolidate", "--load", f"{T}/ck", "--output", f"{T}/no/x.safetensors"],
            "no directory",
        ),
        (
            "convert_checkpoint",
            ["export-hf", "--load", f"{T}/ck", "--output", f"{T}/ck"],
            "not an empty directory",
        ),
        (
            "convert_checkpoint",
            ["import-hf", "--input", f"{T}/none", "--save", f"{T}/out"],
            "--input",
        ),
        (
            "convert_checkpoint",
            ["import-hf", "--input", f"{T}", "--save", f"{T}/ck"],
            "already holds a checkpoint",
        ),
        (
            "convert_checkpoint",
            ["export-megatron", "--load", f"{T}/ck", "--save", f"{T}"],
            "exists and is not an empty directory",
        ),
        (
            "convert_checkpoint",
            [
                "export-megatron",
                "--load",
                f"{T}/ck",
                "--save",
                f"{T}/out",
                "--tensor-model-parallel-size",
                "3",
            ],
            "--tensor-model-parallel-size 3 does not divide the model's --num-attention-heads 4",
        ),
        (
            "convert_checkpoint",
            [
                "export-megatron",
                "--load",
                f"{T}/ck",
                "--save",
                f"{T}/out",
                "--expert-model-parallel-size",
                "2",
            ],
            "the model has no experts",
        ),
        ("convert_checkpoint", ["bogus"], "invalid choice: 'bogus'"),
        ("convert_checkpoint", ["consolidate", "--lod", "x", "--output", "y"], "--load"),
        ("convert_checkpoint", [], "the following arguments are required: command"),
        ("launch", ["--nproc-per-node", "0", "-m", "recipes.gpt_pretrain"], "--nproc-per-node 0"),
        (
            "launch",
            ["--nproc-per-node", "two", "-m", "recipes.gpt_pretrain"],
            "--nproc-per-node two",
        ),
        ("launch", ["--nnodes", "0", "-m", "recipes.gpt_pretrain"], "--nnodes 0"),
        ("launch", ["--nnodes", "2:1", "-m", "recipes.gpt_pretrain"], "--nnodes 2:1"),
        ("launch", ["--master-port", "99999", "-m", "recipes.gpt_pretrain"], "--master-port 99999"),
        ("launch", ["--master-port", "0", "-m", "recipes.gpt_pretrain"], "--master-port 0"),
        (
            "launch",
            ["--nproc-per-nod", "2", "-m", "recipes.gpt_pretrain"],
            "unrecognized argument --nproc-per-nod",
        ),
        ("launch", ["--node-rank", "-1", "-m", "recipes.gpt_pretrain"], "--node-rank -1"),
    ]
    if not torch.cuda.is_available():
        out += [
            ("generate", [*load, "--prompt", "x", "--device", "cuda"], "--device cuda"),
            (
                "launch",
                ["--nproc-per-node", "gpu", "-m", "recipes.gpt_pretrain"],
                "--nproc-per-node gpu",
            ),
        ]
    return out


CASES = [
    ("gpt_pretrain", argv, needle) for argv, needle in runner_cases() if needle
] + recipe_cases()


@pytest.fixture(scope="module")
def small_checkpoint_dir(tmp_path_factory):
    """One tiny checkpoint (built in this process, as convert_checkpoint's import-hf writes one)."""
    from harness.checkpoints import save_one

    root = tmp_path_factory.mktemp("bad_input_ck") / "ck"
    save_one(root, 1)
    return root


def test_there_are_at_least_150_distinct_cases():
    assert len({(name, tuple(argv)) for name, argv, _ in CASES}) >= 150


@pytest.mark.parametrize(
    "name, argv, needle", CASES, ids=[f"{c[0]}:{' '.join(c[1])[:50]}" for c in CASES]
)
def test_bad_input_is_one_line_exit_2_no_traceback_nothing_left(
    tmp_path, monkeypatch, small_checkpoint_dir, name, argv, needle
):
    import shutil

    shutil.copytree(small_checkpoint_dir, tmp_path / "ck")
    (tmp_path / "in.jsonl").write_text('{"text": "hello"}\n')
    assert_one_line_exit_2_nothing_left(tmp_path, monkeypatch, name, argv, needle)
