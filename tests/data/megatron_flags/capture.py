"""The flags of Megatron-LM main's GPT training configurations and example scripts, kept as data
(run by hand).

    # rewrites flag_sets.json beside it
    MLM=/path/to/Megatron-LM [MLM_COMMIT=sha] python tests/data/megatron_flags/capture.py

functional_tests: each GPT, MoE and Mixtral functional-test configuration that trains (no MODE, or
MODE pretraining: the inference and RL ones run other entry points), its MODEL_ARGS* flags and their
values as written. examples: each script under examples/ that launches pretrain_gpt.py, the flags
its text names, less those of the tools around it (torchrun, srun, sbatch, nsys, the scripts' own
arguments: NOT_MEGATRONS). tests/test_megatron_flag_sets.py checks that fmeg's parser knows every
one of them.
"""

import json
import os
import re
import subprocess
from pathlib import Path

import yaml

HERE = Path(__file__).parent
MLM = Path(os.environ.get("MLM", "Megatron-LM"))
NOT_MEGATRONS = {
    # torchrun and its launch variables
    "--nproc_per_node",
    "--nnodes",
    "--node_rank",
    "--master_addr",
    "--master_port",
    "--rdzv_id",
    "--rdzv_backend",
    "--rdzv_endpoint",
    # srun / sbatch / pyxis
    "--account",
    "--container-image",
    "--container-mounts",
    "--container-workdir",
    "--dependency",
    "--exclusive",
    "--gres",
    "--job-name",
    "--mem",
    "--mpi",
    "--nodes",
    "--ntasks-per-node",
    "--output",
    "--overcommit",
    "--partition",
    "--time",
    # nsys profile
    "--capture-range",
    "--capture-range-end",
    "--cpuctxsw",
    "--cuda-graph-trace",
    "--cuda-memory-usage",
    "--sample",
    "--trace",
    # examples/gptoss/02_train.sh's own arguments
    "--checkpoint-path",
    "--data",
    "--distributed-config-file",
    "--tensorboard-logs-path",
    "--tokenizer",
}
# sc21's scripts predate Megatron-LM main's parser: it has no --activations-checkpoint-method (now
# --recompute-method), so Megatron itself stops at it
REMOVED_FROM_MEGATRON = {"--activations-checkpoint-method"}


def functional_tests() -> dict:
    out = {}
    for kind in ("gpt", "moe", "mixtral"):
        for path in sorted(
            (MLM / "tests/functional_tests/test_cases" / kind).glob("*/model_config.yaml")
        ):
            config = yaml.safe_load(path.read_text())
            if config.get("MODE") not in (None, "pretraining"):
                continue
            flags = {}
            for key in sorted(k for k in config if k.startswith(("MODEL_ARGS", "BASE_MODEL_ARGS"))):
                flags |= {flag: value for flag, value in (config[key] or {}).items()}
            out[f"{kind}/{path.parent.name}"] = {
                flag: str(value) for flag, value in sorted(flags.items())
            }
    return out


def examples() -> dict:
    out = {}
    for path in sorted((MLM / "examples").rglob("*.sh")):
        text = path.read_text()
        if (
            "pretrain_gpt" not in text
            and "run_figure" not in path.name
            and "run_table" not in path.name
        ):
            continue
        flags = (
            set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9_-]+)", text))
            - NOT_MEGATRONS
            - REMOVED_FROM_MEGATRON
        )
        out[str(path.relative_to(MLM))] = sorted(flags)
    return out


def main() -> None:
    commit = (
        os.environ.get("MLM_COMMIT")
        or subprocess.run(
            ["git", "-C", str(MLM), "rev-parse", "HEAD"], capture_output=True, text=True
        ).stdout
    )
    record = {
        "megatron_lm": commit.strip() or "unknown",
        "functional_tests": functional_tests(),
        "examples": examples(),
    }
    (HERE / "flag_sets.json").write_text(json.dumps(record, indent=1) + "\n")
    print(len(record["functional_tests"]), "configurations,", len(record["examples"]), "scripts")


if __name__ == "__main__":
    main()
