"""Read a transformers model directory (config.json and safetensors weights) or refuse it in one
line.

    # a transformers causal LM in fp32, every weight from the files
    model, extra = read_model_dir("hf_model/")

What is read: config.json, and the weights as safetensors only (model.safetensors, or the shards
that model.safetensors.index.json names), through transformers' from_pretrained with local files
only. A directory holding only pickled weights (pytorch_model.bin, *.pt) is refused: nothing is ever
unpickled. Every failure is a ValueError naming the file or the tensor: a damaged or truncated
safetensors file, a config.json that disagrees with the weights (a weight missing, left over or of
another shape: transformers would start it at random or drop it), and a weight holding NaN or inf.
Tensors the files hold that transformers' model has no place for but fmeg has (DeepSeek-V3's
multi-token prediction depths, named by extra_prefixes) are read as they lie in the files and
returned beside the model.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import torch

PICKLED_WEIGHTS = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl")
INDEX = "model.safetensors.index.json"


class ImportNotice(UserWarning):
    """Something an import leaves out of what config.json announces (recipes.convert_checkpoint
    prints each on one line); the import goes on."""


def _json_object(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(
            f"--input {path.parent}: no {path.name}; a transformers model directory holds "
            "config.json and its weights"
        ) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"--input {path}: not readable JSON ({e}); restore the file") from None
    if not isinstance(value, dict):
        raise ValueError(
            f"--input {path}: holds a JSON {type(value).__name__}, not an object; restore the file"
        )
    return value


def weight_files(root: Path) -> list[Path]:
    """The safetensors files holding the model's weights, each checked to open (its header read)."""
    from safetensors import SafetensorError, safe_open

    if (root / INDEX).exists():
        weight_map = _json_object(root / INDEX).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(
                f"--input {root / INDEX}: no weight_map of tensor names to files; restore the file"
            )
        files = sorted({root / str(name) for name in weight_map.values()})
    elif (root / "model.safetensors").exists():
        files = [root / "model.safetensors"]
    else:
        pickled = sorted(p.name for pattern in PICKLED_WEIGHTS for p in root.glob(pattern))
        if pickled:
            raise ValueError(
                f"--input {root}: holds only pickled weights ({', '.join(pickled[:3])}) and fmeg "
                "never unpickles; save them as safetensors where you trust the file "
                "(transformers: from_pretrained(dir).save_pretrained(new_dir, "
                "safe_serialization=True))"
            )
        raise ValueError(
            f"--input {root}: no model.safetensors or {INDEX}; a transformers model directory "
            "holds config.json and its weights"
        )
    for path in files:
        try:
            with safe_open(str(path), framework="pt"):
                pass
        except FileNotFoundError:
            raise ValueError(
                f"--input {path}: missing, though {INDEX} names it; download it again"
            ) from None
        except (SafetensorError, OSError) as e:
            raise ValueError(
                f"--input {path}: not a readable safetensors file ({e}); download it again"
            ) from None
    return files


def _refuse_disagreement(root: Path, info: dict, extra_prefixes: tuple[str, ...] = ()) -> None:
    """One line naming the first weight that config.json and the files disagree on, if any (the
    names under extra_prefixes are fmeg's to read)."""
    info = {
        **info,
        "unexpected_keys": [k for k in info["unexpected_keys"] if not k.startswith(extra_prefixes)],
    }
    if info["mismatched_keys"]:
        name, saved, built = sorted(info["mismatched_keys"])[0]
        raise ValueError(
            f"--input {root}: config.json disagrees with the weights: {name} is {list(saved)} in "
            f"the files but {list(built)} by config.json ({len(info['mismatched_keys'])} such "
            "weights); use the config.json that came with the weights"
        )
    for kind, meaning in (
        ("missing_keys", "config.json asks for it and the files lack it"),
        ("unexpected_keys", "the files hold it and config.json has no place for it"),
    ):
        if info[kind]:
            names = sorted(info[kind])
            raise ValueError(
                f"--input {root}: config.json disagrees with the weights: {names[0]} ({meaning}; "
                f"{len(names)} such weights); use the config.json that came with the weights"
            )
    if info.get("error_msgs"):
        raise ValueError(
            f"--input {root}: the weights do not load: "
            f"{' '.join(str(info['error_msgs'][0]).split())}"
        )


def refuse_non_finite(root: Path, model: Any) -> None:
    """One line naming the first weight holding NaN or inf."""
    for name, value in model.state_dict().items():
        if value.is_floating_point():
            bad = int((~torch.isfinite(value)).sum())
            if bad:
                kind = "NaN" if torch.isnan(value).any() else "inf"
                raise ValueError(
                    f"--input {root}: weight {name} holds {kind} ({bad} of {value.numel()} "
                    "values); fmeg imports finite weights only: download the file again or repair "
                    "the weight"
                )


# model types whose checkpoints ship their own modelling code (never run here) for a class
# transformers has
# Kimi-K2: DeepseekV3ForCausalLM with its own model_type
SAME_AS = {"kimi_k2": "deepseek_v3"}


def _config_transformers_holds(fields: dict, root: Path) -> Any:
    """transformers' config for a model type it does not know but holds under another name
    (SAME_AS), else None (from_pretrained reads config.json itself)."""
    import transformers

    holder = SAME_AS.get(fields["model_type"])
    if holder is None:
        return None
    skipped = (
        "model_type",
        "auto_map",
        "architectures",
        "transformers_version",
        "torch_dtype",
        "dtype",
    )
    try:
        return transformers.AutoConfig.for_model(
            holder, **{k: v for k, v in fields.items() if k not in skipped}
        )
    except (ValueError, TypeError) as e:
        raise ValueError(
            f"--input {root / 'config.json'}: not a {holder} configuration as its model_type "
            f"{fields['model_type']!r} implies ({' '.join(str(e).split())[:200]})"
        ) from None


def _config_errors() -> tuple[type, ...]:
    """huggingface_hub's validation error for a config's fields (not a ValueError), where it
    exists."""
    try:
        from huggingface_hub.errors import StrictDataclassError
    except ImportError:
        return ()
    return (StrictDataclassError,)


def read_model_dir(
    input_dir: str, extra_prefixes: Callable[[Any], tuple[str, ...]] = lambda _: ()
) -> tuple[Any, dict[str, torch.Tensor]]:
    """(a transformers causal LM in fp32, {name: tensor} of the files' tensors under
    extra_prefixes(its config)), read from input_dir's config.json and safetensors files."""
    import transformers
    from safetensors import safe_open

    root = Path(input_dir)
    fields = _json_object(root / "config.json")
    if not fields.get("model_type"):
        raise ValueError(
            f"--input {root / 'config.json'}: no model_type; use the config.json that came with "
            "the weights"
        )
    quantized = fields.get("quantization_config")
    if isinstance(quantized, dict) and quantized:
        raise ValueError(
            f"--input {root}: its weights are quantized ({quantized.get('quant_method', 'see')} "
            "quantization_config, as DeepSeek-V3 and Kimi-K2 are released in FP8 blocks); fmeg "
            "imports bf16 or fp32 weights: convert them first (DeepSeek-V3's "
            "inference/fp8_cast_bf16.py)"
        )
    config = _config_transformers_holds(fields, root)
    files = weight_files(root)
    verbosity = transformers.logging.get_verbosity()
    # its load report and progress bars: fmeg reports in one line
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    try:
        model, info = transformers.AutoModelForCausalLM.from_pretrained(
            str(root),
            local_files_only=True,
            use_safetensors=True,
            output_loading_info=True,
            ignore_mismatched_sizes=True,
            dtype=torch.float32,
            **({"config": config} if config else {}),
        )
    # config.json's own fields (layer_types too short, say) fail validation
    except _config_errors() as e:
        raise ValueError(
            f"--input {root / 'config.json'}: transformers refuses it: "
            f"{' '.join(str(e.__cause__ or e).split())[:300]}; use the config.json that came with "
            "the weights"
        ) from None
    except (ValueError, OSError, RuntimeError, KeyError, TypeError) as e:
        raise ValueError(
            f"--input {root}: transformers cannot build the model from it: "
            f"{' '.join(str(e).split())[:300]}"
        ) from None
    finally:
        transformers.logging.set_verbosity(verbosity)
        transformers.logging.enable_progress_bar()
    prefixes = extra_prefixes(model.config)
    _refuse_disagreement(root, info, prefixes)
    refuse_non_finite(root, model)
    extra = {}
    for path in files if prefixes else ():
        with safe_open(str(path), framework="pt") as f:
            extra |= {
                name: f.get_tensor(name).float() for name in f.keys() if name.startswith(prefixes)
            }
    for name, value in extra.items():
        if not torch.isfinite(value).all():
            raise ValueError(
                f"--input {root}: weight {name} holds NaN or inf; fmeg imports finite weights "
                "only: download the file again or repair the weight"
            )
    return model.eval(), extra


def add_weight_file(root: Path, name: str, tensors: dict[str, torch.Tensor]) -> None:
    """Write tensors into root/name beside save_pretrained's weights and name them in
    model.safetensors.index.json (made from model.safetensors when save_pretrained wrote one file),
    so the directory lists every weight."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    save_file(
        {k: v.contiguous() for k, v in tensors.items()}, str(root / name), metadata={"format": "pt"}
    )
    if (root / INDEX).exists():
        index = _json_object(root / INDEX)
    else:
        with safe_open(str(root / "model.safetensors"), framework="pt") as f:
            index = {"metadata": {}, "weight_map": {k: "model.safetensors" for k in f.keys()}}
    index["weight_map"] |= {k: name for k in tensors}
    index["metadata"]["total_size"] = sum(
        (root / f).stat().st_size for f in set(index["weight_map"].values())
    )
    (root / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
