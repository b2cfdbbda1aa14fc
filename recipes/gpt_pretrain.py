"""Pretrain a GPT under torchrun with any tensor/sequence/pipeline/data-parallel layout.

    torchrun --nproc-per-node 4 -m recipes.gpt_pretrain --tensor-model-parallel-size 2 \\
        --pipeline-model-parallel-size 2
    python -m recipes.gpt_pretrain --config run.yaml --train-iters 50        # one process

main() reads as its phases: prepare (parse and validate the flags, read the tokenizer and the data,
and turn them into one frozen RunConfig; bad input is one line per problem and exit 2, before any
process group exists), start the session (device and process groups), build or restore the state
(initialised as on one device, then sharded, so the loss curve does not depend on the layout),
train, finish.
"""

from __future__ import annotations

import time

# --exit-duration-in-mins counts from here, as Megatron's does from process start
PROCESS_START = time.time()

import dataclasses  # noqa: E402 - after the clock
import logging  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402

from fmeg import checkpoint, tree  # noqa: E402
from fmeg.cli import print_refusal  # noqa: E402
from fmeg.data.blending import build_datasets, parse_split, target_samples  # noqa: E402
from fmeg.data.default_corpus import cache_dir as fmeg_cache, default_corpus  # noqa: E402
from fmeg.data.fim import FIM  # noqa: E402
from fmeg.data.mock_corpus import mock_corpus  # noqa: E402
from fmeg.data.sft_dataset import build_sft_datasets  # noqa: E402
from fmeg.training import report  # noqa: E402
from fmeg.config.load import BadInput, load  # noqa: E402
from fmeg.config.run_config import RunConfig  # noqa: E402
from fmeg.training.run_state import Checkpointer, MissingCheckpoint, build_or_restore  # noqa: E402
from fmeg.training.session import Session  # noqa: E402
from fmeg.training.trainer import Trainer  # noqa: E402


def prepare(argv: list[str] | None, world: int):
    """(RunConfig, training data, validation data) of the command line, or BadInput. Everything a
    user can get wrong is found here, before any process group exists."""
    cfg, tokenizer = load(argv, world)
    d, t = cfg.data, cfg.training
    data_path = (
        list(d.data_path)
        if d.data_path
        else [
            (
                mock_corpus(tokenizer.vocab_size, tokenizer.eod) if d.mock else default_corpus()
            ).prefix
        ]
    )
    samples = target_samples(
        t.train_iters,
        cfg.global_batch,
        t.eval_interval or 0,
        t.eval_iters if t.eval_interval else 0,
    )
    try:
        train, valid, cfg = _datasets(cfg, tokenizer, data_path, samples)
    # DataError, or a split / blend / sequence length the data cannot serve
    except ValueError as e:
        raise BadInput(str(e)) from None
    return _check_splits(cfg, train, valid, data_path, samples)


def _datasets(cfg: RunConfig, tokenizer, data_path: list, samples: list):
    """(training data, validation data, cfg with the SFT data's notices) of the flags' data."""
    d, t = cfg.data, cfg.training
    if d.sft:
        (train, valid, _), said = build_sft_datasets(
            data_path,
            d.split,
            d.seq_length,
            [samples[0], samples[1], 0],
            tokenizer,
            cache_dir=d.cache_path or fmeg_cache(),
            cp=cfg.layout.cp,
            packing=d.sft_sequence_packing,
        )
        cfg = dataclasses.replace(cfg, notices=cfg.notices + tuple(said))
    else:
        train, valid, _ = build_datasets(
            data_path,
            d.split,
            d.seq_length,
            [samples[0], samples[1], 0],
            t.seed,
            cache_dir=d.cache_path,
            eod_id=tokenizer.eod,
            eod_mask_loss=d.eod_mask_loss,
            reset_position_ids=d.reset_position_ids,
            reset_attention_mask=d.reset_attention_mask,
            fim=FIM.of(d.fim, tokenizer) if d.fim else None,
            vocab_size=tokenizer.vocab_size,
        )
    return train, valid, cfg


def _check_splits(cfg: RunConfig, train, valid, data_path: list, samples: list):
    """(cfg, train, valid), or BadInput where a split the run needs has no documents."""
    d, t = cfg.data, cfg.training
    if train is None and samples[0]:
        raise BadInput(
            f"--data-path {' '.join(data_path)}: the training split has no documents (an empty "
            f"dataset, or --split {d.split} gives it no share); give it data or a share"
        )
    # Megatron's do_valid = False
    if t.eval_interval and valid is None and parse_split(d.split)[1] == 0:
        cfg = dataclasses.replace(
            cfg,
            training=dataclasses.replace(t, eval_interval=None),
            notices=cfg.notices
            + (
                f"--split {d.split} gives validation no share: no validation, --eval-interval has "
                "no effect (as in Megatron)",
            ),
        )
    # found now, not at the first evaluation
    elif t.eval_interval and valid is None:
        raise BadInput(
            f"--split {d.split} leaves the validation split of {' '.join(data_path)} no documents; "
            "give it a larger share, or leave out --eval-interval"
        )
    return cfg, train, valid


def announce(cfg: RunConfig, session: Session, state, per_rank: list[int]) -> None:
    """The start line, the ignored flags, the warnings, the theoretical memory and every rank's
    persistent state (on the last rank)."""
    layout, precision, model = cfg.layout, cfg.precision, cfg.model
    local = tree.num_params(state.params)
    opt = state.opt_state
    moments = [(m.mu, m.nu or ()) for name, m in opt.items() if name != "main"]
    # the matrix optimizers' per-matrix state (SOAP's) at the matrices' home ranks
    moments += [[s for s, _ in part.matrix_states().values()] for part in state.parts]
    state_bytes = sum(
        x.numel() * x.element_size() for x in tree.tree_leaves((moments, opt.get("main", ())))
    )
    reduced_in = (
        ""
        if precision.grad_dtype == torch.float32
        else f" (gradients reduced in {str(precision.grad_dtype).removeprefix('torch.')})"
    )
    in_flight = min(layout.pp, layout.microbatches(cfg.global_batch)) * layout.chunks
    element_bytes = precision.compute_dtype.itemsize
    estimate = report.memory_estimate(
        local,
        state_bytes,
        model,
        layout.micro_batch_size,
        cfg.data.seq_length,
        layout.tp,
        layout.pp,
        in_flight,
        element_bytes,
        cp=layout.cp,
        layers=report.last_rank_layers(model, layout),
    )
    print(
        f"fmeg gpt_pretrain on {session.device}: world {session.world} = {layout.describe()}; "
        f"{model.num_layers} layers, hidden {model.hidden_size}, vocab {model.vocab_size} (padded "
        f"to {model.padded_vocab_size}), {precision.name}{reduced_in}, layers "
        f"{'compiled' if session.compile else 'eager'}; {local / 1e6:.2f}M parameters on this "
        "rank; global batch "
        f"{cfg.global_batch}{' (ramped up)' if cfg.training.batch.varies else ''}; "
        f"optimizer {cfg.training.optimizer.label}, its state "
        f"{state_bytes:,} bytes on this rank{' (distributed optimizer)' if state.zero else ''}; "
        f"persistent state {state.bytes_per_parameter():.2f} bytes per parameter",
        flush=True,
    )
    if precision.fp8 is not None:
        print(report.fp8_line(cfg, session), flush=True)
    for line in cfg.ignored:
        print(f"ignored {line}", flush=True)
    for line in cfg.notices:
        print(f"warning: {line}", flush=True)
    scores = "with" if report.holds_attention_scores(model) else "without"
    print(
        "theoretical memory on this rank (MB): "
        + ", ".join(f"{k} {v / 2**20:.1f}" for k, v in estimate.items())
        + f" (activations of {in_flight} microbatch{'es' if in_flight > 1 else ''} in flight, "
        f"{scores} attention scores, Korthikanti's count)",
        flush=True,
    )
    if layout.pp > 1:
        print(report.stages_line(model, layout, cfg.data.seq_length, element_bytes), flush=True)
    print(
        "persistent state per rank (MB): "
        + ", ".join(f"r{r} {b / 2**20:.2f}" for r, b in enumerate(per_rank)),
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        cfg, train_data, valid_data = prepare(argv, world)
    except BadInput as e:
        return refuse(e.lines)
    if cfg.logging.logging_level is not None:
        logging.basicConfig(level=cfg.logging.logging_level)
    session = Session.start(cfg)
    torch.manual_seed(cfg.training.seed)
    try:
        state, progress, said = build_or_restore(cfg, session)
    except (checkpoint.CheckpointError, MissingCheckpoint) as e:
        return refuse([str(e)])
    for line in said if session.last_rank else ():
        print(line, flush=True)
    checkpointer = Checkpointer(cfg, session) if cfg.checkpoint.save else None
    # every rank's persistent state, for the start line (one all-gather, before training)
    per_rank = session.every_rank(state.persistent_bytes())
    if session.last_rank:
        announce(cfg, session, state, per_rank)
    code = Trainer(
        cfg, session, state, progress, train_data, valid_data, checkpointer, PROCESS_START
    ).run()
    session.close()
    return code


def refuse(lines) -> int:
    """Print the lines once per job (fmeg.cli.print_refusal); the exit code for bad input."""
    print_refusal(lines)
    return 2


def _gone_peer(e: BaseException) -> bool:
    """Whether a collective failed because another rank stopped (killed, or failed on its own), by
    the words gloo and NCCL use for it; any other error keeps its traceback."""
    return any(
        words in str(e)
        for words in (
            "Connection closed by peer",
            "Connection reset by peer",
            "Broken pipe",
            "remote process exited",
        )
    )


def _timed_out(e: BaseException) -> bool:
    """Whether a collective gave up waiting for another rank (--distributed-timeout-minutes), by
    gloo's and NCCL's words."""
    return any(
        words in str(e)
        for words in ("Timed out waiting", "collective operation timeout", "Socket Timeout")
    )


def _report_silent_ranks(e: BaseException) -> None:
    """One line, printed by the lowest rank that timed out, naming the ranks that did not answer a
    roll call (stopped, say by SIGSTOP, or hung); every rank that timed out then ends."""
    import re

    import torch.distributed as dist

    from fmeg.training.session import silent_ranks

    silent = silent_ranks()
    here = [r for r in range(dist.get_world_size()) if r not in silent]
    waited = re.search(r"(\d+)\s*ms", str(e))
    limit = (
        f" (it waited {int(waited.group(1)) / 1000:g} s: --distributed-timeout-minutes)"
        if waited
        else ""
    )
    if here and int(os.environ.get("RANK", "0")) == min(here):
        who = f"rank {', '.join(map(str, silent))}" if silent else "another rank"
        print(
            f"error: {who} stopped answering: rank {min(here)} timed out waiting for it{limit}; it "
            "is stopped or hung, and the job ends here (fmeg.launch --max-restarts N restarts it "
            "from the newest checkpoint)",
            file=sys.stderr,
            flush=True,
        )


if __name__ == "__main__":
    try:
        sys.exit(main())
    except RuntimeError as e:
        if _timed_out(e):
            _report_silent_ranks(e)
            sys.stdout.flush()
            # the process group cannot be taken down cleanly with a rank missing
            os._exit(1)
        if not _gone_peer(e):
            raise
        said = next(line for line in str(e).splitlines() + [""] if line.strip())[:160]
        print(
            f"error: rank {os.environ.get('RANK', '0')} lost contact with another rank, which "
            f"stopped or was killed; its output says why ({said})",
            file=sys.stderr,
            flush=True,
        )
        sys.stdout.flush()
        # tearing down a process group with a rank gone can abort (SIGABRT) under load
        os._exit(1)
