"""Conversions between fmeg parameter pytrees and other libraries' models."""

import logging


class _TorchaoImportLines(logging.Filter):
    """Drops the lines torchao logs as it is imported, where its compiled kernels do not load (a
    CUDA or other-Python build) and torch finds its enums registered twice; any other record
    passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if record.name == "torchao":
            return not (message.startswith("Failed to load ") and "torchao" in message)
        if record.name == "torch.utils._pytree":
            what = record.args[0] if isinstance(record.args, tuple) and record.args else None
            from_torchao = getattr(what, "__module__", "").startswith("torchao")
            return not (from_torchao and "register_constant() on Enum subclasses" in message)
        return True


def quiet_torchao() -> None:
    """Silences the four lines torchao's import writes to stderr (two kernels it cannot load, two
    torch deprecations of its own calls): transformers imports torchao, where it is installed (the
    test extra), as soon as it builds or loads a model, and fmeg uses none of torchao's kernels."""
    for name in ("torchao", "torch.utils._pytree"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _TorchaoImportLines) for f in logger.filters):
            logger.addFilter(_TorchaoImportLines())


# every conversion here may build a transformers model, and so import torchao
quiet_torchao()
