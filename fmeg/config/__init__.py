"""Megatron's flags for the runner: the parser (arguments), the flags Megatron scripts carry that
fmeg ignores or refuses (megatron_flags and the per-feature *_flags modules), their checks
(validation) and the frozen configuration the runner reads (run_config.RunConfig). The argparse
Namespace stays in this package: load() gives the runner its RunConfig and tokenizer.

    python -m fmeg.config.flags_doc > docs/flags.md    # every flag, its default and meaning
"""
