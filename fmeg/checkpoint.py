"""Checkpoints as safetensors shards plus JSON metadata; resume bitwise or in any other layout.

    DIR/iter_0000010/rank_00003.safetensors   this rank's parameter and optimizer shards, readable names:
                                              params/<stage>/<path>, mu/<stage>/<path>, nu/..., main/...,
                                              or mu/shard, nu/shard, main/shard with the distributed optimizer;
                                              one copy of each replicated tensor (written_here)
    DIR/iter_0000010/rank_00003.json          this rank's coordinates, its file's sha256, the names of its
                                              whole state in pytree order, and for every tensor it wrote its
                                              local shape, global shape and offset in the global tensor
    DIR/iter_0000010/metadata.json            layout, model config, iteration, consumed samples (the data
                                              sampler's and the LR/WD schedules' position), loss scale,
                                              arguments, and every rank file's entry (written last). There is
                                              no RNG state to save: dropout and data order are functions of
                                              (seed, iteration, sample index).
    DIR/latest_checkpointed_iteration.txt     the newest complete checkpoint (moved last)

A checkpoint is written into iter_XXXXXXX.tmp-<attempt> (a token the ranks of one run share, new for
every run) and renamed when complete, so a killed save leaves only a directory that loading ignores and a
restart never writes into; remove_stale deletes such leftovers when a run starts. Nothing is ever unpickled.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from fmeg import tree
from fmeg.models import gpt, moe
from fmeg.models import gpt_pipeline as gp
from fmeg.parallel.sharding import unshard
from fmeg.parallel.zero import FlatBuffer

LATEST = "latest_checkpointed_iteration.txt"


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded as asked; the message names the file."""


def iteration_dir(root: str | os.PathLike, iteration: int) -> Path:
    return Path(root) / f"iter_{iteration:07d}"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _named(prefix: str, stages: dict[int, Any]) -> dict[str, torch.Tensor]:
    return {f"{prefix}/{s}/{path}": t for s, stage in stages.items() for path, t in tree.items(stage)}


def state_tensors(params: dict[int, Any], opt_state: dict) -> dict[str, torch.Tensor]:
    """Every tensor a rank must save, under readable names, copied to host memory."""
    out = _named("params", params)
    adam = opt_state["adam"]
    out["adam/count"] = adam.count
    for name, value in (("mu", adam.mu), ("nu", adam.nu), ("main", opt_state.get("main"))):
        if value is None:
            continue
        if isinstance(value, dict) and "shard" in value:  # flat slices (the experts' own under expert parallelism)
            out.update({f"{name}/{k}": v for k, v in value.items()})
        else:
            out.update(_named(name, value))
    return {k: v.detach().to("cpu", copy=True).contiguous() for k, v in out.items()}


def written_here(names: list[str], coords: dict[str, int], experts_apart: bool) -> list[str]:
    """The names a rank writes: its slices of the distributed optimizer's state and the step count always; a tensor
    that other ranks hold too only on the first of them (as Megatron's data-parallel rank 0 writes the model): the
    dense leaves on data- and context-parallel coordinate 0, the experts' leaves laid out apart on expert-dp
    coordinate 0. So a checkpoint holds one copy of each tensor, whatever dp and cp are."""
    dense = coords.get("dp", 0) == 0 and coords.get("cp", 0) == 0
    experts = coords.get("edp", 0) == 0 if experts_apart else dense
    return [n for n in names if _always_written(n) or (experts if experts_apart and _is_expert(n) else dense)]


def _always_written(name: str) -> bool:
    head, _, rest = name.partition("/")
    return head == "adam" or rest in ("shard", "expert_shard")


def _is_expert(name: str) -> bool:
    return ".mlp.experts." in "." + name.split("/", 2)[-1]


def describe(tensors: dict[str, torch.Tensor], coords: dict[str, int], sizes: dict[str, int]) -> dict[str, dict]:
    """For every saved tensor: its shape here, the global (unsharded) shape and this shard's offsets.

    Tree tensors are tensor-parallel slices along their partition dimension (gpt.TP_RULES), the experts' also
    expert-parallel slices along their first dimension (moe.EP_RULES); flat
    distributed-optimizer slices are pieces of this (tp, pp) rank's flattened parameters, offset by dp x cp."""
    from fmeg.parallel.sharding import partition_of

    out = {}
    for name, t in tensors.items():
        shape, offset = list(t.shape), [0] * t.dim()
        kind, _, rest = name.partition("/")
        if rest == "shard":  # a slice over dp x cp (cp inside dp, megatron-core's order)
            shape = [t.shape[0] * sizes.get("dp", 1) * sizes.get("cp", 1)]
            offset = [t.shape[0] * (coords.get("dp", 0) * sizes.get("cp", 1) + coords.get("cp", 0))]
        elif rest == "expert_shard":  # a slice over expert_dp of this rank's experts' flat state
            shape = [t.shape[0] * sizes.get("edp", 1)]
            offset = [t.shape[0] * coords.get("edp", 0)]
        elif kind != "adam":
            leaf = rest.partition("/")[2]
            part = partition_of(leaf, gpt.TP_RULES)
            expert = partition_of(leaf, moe.EP_RULES) is not None
            axis = "etp" if expert and "etp" in sizes else "tp"  # the experts' own tp when laid out apart
            if part is not None and t.dim():
                dim = part.dim % t.dim()
                shape[dim] *= sizes.get(axis, 1)
                offset[dim] = t.shape[dim] * coords.get(axis, 0)
            if expert and sizes.get("ep", 1) > 1:  # experts: split over ep along their first dimension
                shape[0] *= sizes["ep"]
                offset[0] = t.shape[0] * coords.get("ep", 0)
        out[name] = {"local_shape": list(t.shape), "global_shape": shape, "offset": offset,
                     "dtype": str(t.dtype).removeprefix("torch.")}
    return out


def temporary_dir(root: str | os.PathLike, iteration: int, attempt: str) -> Path:
    return Path(root) / f"iter_{iteration:07d}.tmp-{attempt}"


_COMPLETE = re.compile(r"iter_\d{7}")
_TEMPORARY = re.compile(r"iter_\d{7}\.tmp(-[0-9a-f]+)?")  # older fmeg wrote ".tmp" alone


def _ours(root: str | os.PathLike, pattern: re.Pattern) -> list[Path]:
    """The directories under root whose names are exactly fmeg's (never a user's iter_0000004.bak, a file or
    a symlink)."""
    return sorted(p for p in Path(root).iterdir() if pattern.fullmatch(p.name) and p.is_dir() and not p.is_symlink()) \
        if Path(root).is_dir() else []


def remove_stale(root: str | os.PathLike) -> list[str]:
    """Delete the temporary directories that interrupted saves left under root; returns their names. Call
    it before this run's first save (every temporary directory is then some dead run's)."""
    stale = _ours(root, _TEMPORARY)
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
    return [p.name for p in stale]


def save_rank(root: str | os.PathLike, iteration: int, rank: int, coords: dict[str, int], tensors: dict,
              sizes: dict[str, int] | None = None, attempt: str = "0", order: list[str] | None = None) -> Path:
    """Write this rank's shard into the temporary directory of `iteration` for this run's `attempt` token
    (the same on every rank); returns that directory. order: the names of the rank's whole state in pytree order,
    those it leaves to another rank included (written_here); default: the names of tensors."""
    tmp = temporary_dir(root, iteration, attempt)
    tmp.mkdir(parents=True, exist_ok=True)
    path = tmp / f"rank_{rank:05d}.safetensors"
    save_file(tensors, str(path))
    # safetensors stores names sorted; the order of the pytree (which flat buffers rely on) is kept here.
    (tmp / f"rank_{rank:05d}.json").write_text(json.dumps({"rank": rank, "coords": coords, "sha256": _sha256(path),
                                                           "names": order or list(tensors),
                                                           "tensors": describe(tensors, coords, sizes or {})}))
    return tmp


def finalize(root: str | os.PathLike, iteration: int, metadata: dict, keep_last: int | None = None,
             attempt: str = "0") -> Path:
    """On one rank, after every rank saved: write metadata with all checksums, rename the directory into
    place, then move the latest pointer; optionally delete all but the newest keep_last checkpoints."""
    root = Path(root)
    tmp, final = temporary_dir(root, iteration, attempt), iteration_dir(root, iteration)
    ranks = sorted((json.loads(p.read_text()) for p in tmp.glob("rank_*.json")), key=lambda r: r["rank"])
    if len(ranks) != metadata["world_size"]:
        raise CheckpointError(f"{tmp}: {len(ranks)} rank files for a world of {metadata['world_size']}")
    metadata = {**metadata, "iteration": iteration, "files": {f"rank_{r['rank']:05d}.safetensors": r for r in ranks}}
    (tmp / "metadata.json.tmp").write_text(json.dumps(metadata, indent=1, sort_keys=True))
    os.replace(tmp / "metadata.json.tmp", tmp / "metadata.json")
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    pointer = root / (LATEST + ".tmp")
    pointer.write_text(str(iteration))
    os.replace(pointer, root / LATEST)
    if keep_last:
        prune(root, keep_last)
    return final


def prune(root: str | os.PathLike, keep: int) -> list[str]:
    """Delete all but the newest `keep` complete checkpoints under root; returns the names deleted."""
    done = _ours(root, _COMPLETE)
    for old in done[:-keep] if keep > 0 else done:
        shutil.rmtree(old)
    return [p.name for p in (done[:-keep] if keep > 0 else done)]


def disk_bytes(path: str | os.PathLike) -> int:
    """The bytes of the files under a directory (a checkpoint's size on disk)."""
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def latest(root: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint under root (partial directories are ignored with a warning)."""
    root = Path(root)
    for partial in _ours(root, _TEMPORARY):
        warnings.warn(f"{partial}: an unfinished checkpoint (a save was interrupted); ignoring it")
    pointer = root / LATEST
    if (root / "metadata.json").is_file() and not pointer.is_file():
        raise CheckpointError(f"{root} is one iteration of a checkpoint; give the directory that holds it "
                              f"({root.parent}), which names its newest iteration in {LATEST}")
    if not pointer.is_file():
        return None
    text = pointer.read_text(errors="replace").strip()
    if not text.isdigit():
        raise CheckpointError(f"{pointer}: holds {text[:40]!r}, not an iteration number; write the number of a "
                              f"complete iteration directory there, or delete the file to start from scratch")
    path = iteration_dir(root, int(text))
    if not (path / "metadata.json").is_file():
        raise CheckpointError(f"{pointer}: names {path.name}, which has no metadata.json")
    return path


def model_fields(config: gpt.GPTConfig) -> dict:
    """What must match to resume: the model config less its vocabulary padding (which follows tp and is
    redone on load)."""
    fields = dataclasses.asdict(config)
    fields.pop("padded_vocab_size")
    return _one_spelling(fields)


def _one_spelling(fields: dict) -> dict:
    """kv_channels equal to hidden_size / num_heads is the default head dimension, however it was given."""
    if fields.get("kv_channels") is not None and fields["kv_channels"] * fields["num_heads"] == fields["hidden_size"]:
        fields = {**fields, "kv_channels": None}
    return fields


# Model settings that are not part of any parameter's shape and that a run may change when it loads a
# checkpoint (Megatron loads the weights whatever they are): regularisation, the initialisation (unused on
# load), and RoPE's base and context length (continued pretraining at a longer context).
CHANGEABLE_ON_LOAD = ("hidden_dropout", "attention_dropout", "init_std", "rope_theta",
                      # how experts are trained, not what they are: a run may resume with other balance losses or
                      # capacity
                      "moe_router_load_balancing_type", "moe_aux_loss_coeff", "moe_z_loss_coeff",
                      "moe_expert_capacity_factor", "moe_token_drop_policy", "moe_pad_expert_input_to_capacity",
                      "moe_router_bias_update_rate", "moe_token_dispatcher_type")


def saved_model(meta: dict, where: str) -> dict:
    """The checkpoint's model fields, with the defaults of fields added since it was written; a field this
    fmeg does not know (a newer fmeg wrote it) is a CheckpointError naming it."""
    known = {f.name: f for f in dataclasses.fields(gpt.GPTConfig)}
    unknown = sorted(set(meta.get("model", {})) - set(known))
    if unknown:
        raise CheckpointError(f"{where}: names model fields this fmeg does not know ({', '.join(unknown)}): a newer "
                              "fmeg wrote it; upgrade fmeg to read it")
    defaults = {k: f.default for k, f in known.items() if f.default is not dataclasses.MISSING}
    saved = {**defaults, **{k: tuple(v) if isinstance(v, list) else v for k, v in meta.get("model", {}).items()}}
    saved.pop("padded_vocab_size", None)  # JSON gave tuples (rope_scaling) back as lists
    return _one_spelling(saved)


def changed_on_load(meta: dict, config: gpt.GPTConfig) -> list[str]:
    """'name saved -> now' for each setting that differs but may change on load (CHANGEABLE_ON_LOAD, and the
    context length of a model without learned positions)."""
    saved, now = saved_model(meta, "the checkpoint"), model_fields(config)
    return [f"{k} {saved.get(k)} -> {now[k]}" for k in _changeable(config) if saved.get(k) != now[k]]


def _changeable(config: gpt.GPTConfig) -> tuple[str, ...]:
    return CHANGEABLE_ON_LOAD + (("max_seq_len",) if config.position != "learned" else ())


def read_metadata(path: Path, config: gpt.GPTConfig) -> dict:
    meta_path = path / "metadata.json"
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{meta_path}: unreadable ({e})") from None
    saved, now = saved_model(meta, str(meta_path)), model_fields(config)
    diff = sorted(k for k, v in now.items() if saved.get(k) != v and k not in _changeable(config))
    if diff:
        raise CheckpointError(f"{meta_path}: the checkpoint's model differs from the flags in {', '.join(diff)}")
    for name, info in meta["files"].items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"{file}: missing (the checkpoint lists it)")
        if _sha256(file) != info["sha256"]:
            raise CheckpointError(f"{file}: checksum mismatch; the file is corrupt")
    return meta


def _rank_entry(path: Path, meta: dict, coords: dict[str, int]) -> tuple[str, dict]:
    for name, info in meta["files"].items():
        if all(info["coords"].get(k) == v for k, v in coords.items()):
            return name, info
    raise CheckpointError(f"{path}: no shard for coordinates {coords}")


def _rank_file(path: Path, meta: dict, coords: dict[str, int]) -> dict[str, torch.Tensor]:
    """The tensors the rank at coords wrote, in the saved pytree order."""
    name, info = _rank_entry(path, meta, coords)
    tensors = load_file(str(path / name))
    return {n: tensors[n] for n in info["names"] if n in tensors}


def _with_replicas(path: Path, meta: dict, coords: dict[str, int]) -> dict[str, torch.Tensor]:
    """The whole state of the rank at coords, in its pytree order: what it wrote, and the replicated tensors it
    left to the first rank holding them (written_here)."""
    tensors, (_, info) = _rank_file(path, meta, coords), _rank_entry(path, meta, coords)
    names, coords = info["names"], info["coords"]
    sources: dict[bool, dict[str, torch.Tensor]] = {}
    for n in names:
        if n not in tensors:
            expert = "ep" in meta["layout"] and _is_expert(n)
            if expert not in sources:
                owner = {"pp": coords["pp"], "ep": coords["ep"], "etp": coords["etp"], "edp": 0} if expert else \
                    {"tp": coords["tp"], "pp": coords["pp"], "dp": 0, **({"cp": 0} if "cp" in coords else {})}
                sources[expert] = _rank_file(path, meta, owner)
            tensors[n] = sources[expert][n]
    return {n: tensors[n] for n in names}


def _stage_trees(tensors: dict[str, torch.Tensor], prefix: str) -> dict[int, Any]:
    stages: dict[int, dict] = {}
    for name, t in tensors.items():
        head, _, rest = name.partition("/")
        if head == prefix and rest not in ("shard", "expert_shard"):
            stage, _, path = rest.partition("/")
            stages.setdefault(int(stage), {})[path] = t
    return {s: tree.unflatten(flat) for s, flat in stages.items()}


def full_state(path: Path, meta: dict, config: gpt.GPTConfig) -> dict[str, Any]:
    """The checkpoint as single-rank trees: params, mu, nu (and main), plus the Adam step count; the
    vocabulary tables padded as config pads them. Experts laid out apart (expert parallelism, their own tp) are
    joined from the ranks of the experts' grid."""
    from fmeg.training.expert_state import merge, split_experts

    old = meta["layout"]
    apart = "ep" in old
    out: dict[str, dict[int, Any]] = {}
    for tp_rank in range(old["tp"]):
        for pp_rank in range(old["pp"]):
            files = [(_with_replicas if d == 0 and cp in ({}, {"cp": 0}) else _rank_file)(
                         path, meta, {"tp": tp_rank, "pp": pp_rank, "dp": d, **cp})
                     for d in range(old["dp"]) for cp in _cp_coords(meta)]  # the dp x cp slices, in order
            params = _stage_trees(files[0], "params")
            if apart:
                params = split_experts(params)[0]
            for name in ("params", "mu", "nu", "main"):
                if name == "params":
                    local = params
                elif f"{name}/shard" in files[0]:  # distributed optimizer: join the dp slices
                    local = _joined_slices([f[f"{name}/shard"] for f in files], params)
                else:
                    local = _stage_trees(files[0], name)
                    if not local:
                        continue
                    if apart:
                        local = split_experts(local)[0]
                for s, stage in local.items():
                    out.setdefault(name, {}).setdefault(s, {})[tp_rank] = stage
    joined = {name: {s: unshard([per_tp[t] for t in range(old["tp"])], gpt.TP_RULES, "tp")
                     for s, per_tp in stages.items()} for name, stages in out.items()}
    if apart:
        for name, experts in _full_experts(path, meta).items():
            joined[name] = {s: merge(joined[name][s], experts[s]) for s in joined[name]}
    full = {name: gpt.repad_vocab(gp.merge(stages, config), config, config.padded_vocab_size)
            for name, stages in joined.items()}
    full["count"] = _rank_file(path, meta, {"tp": 0, "pp": 0, "dp": 0})["adam/count"]
    return full


def _cp_coords(meta: dict) -> list[dict[str, int]]:
    """The cp coordinates of the files whose distributed-optimizer slices make the whole state: none when it was
    saved without context parallelism; cp 0 alone when its slices span dp only (fmeg before 2026-11-24, where the
    cp ranks held copies)."""
    layout = meta["layout"]
    if "cp" not in layout:
        return [{}]
    info = next(iter(meta["files"].values()))["tensors"].get("mu/shard")
    if info and info["global_shape"][0] == info["local_shape"][0] * layout["dp"]:
        return [{"cp": 0}]
    return [{"cp": c} for c in range(layout["cp"])]


def _full_experts(path: Path, meta: dict) -> dict[str, dict[int, Any]]:
    """{name: {stage: the experts' leaves, whole}} from the experts' grid: expert-tp slices joined along F, then
    the ep slices along the expert dimension (distributed-optimizer slices joined over expert_dp first)."""
    from fmeg.training.expert_state import split_experts

    old = meta["layout"]
    ep, etp = old["ep"], old["etp"]
    edp = old["dp"] * old["tp"] * old.get("cp", 1) // (ep * etp)
    out: dict[str, dict[int, list]] = {}
    for pp_rank in range(old["pp"]):
        per_ep: dict[str, list] = {}
        for j in range(ep):
            per_tp: dict[str, list] = {}
            for t in range(etp):
                files = [(_with_replicas if k == 0 else _rank_file)(
                             path, meta, {"pp": pp_rank, "ep": j, "etp": t, "edp": k}) for k in range(edp)]
                params = split_experts(_stage_trees(files[0], "params"))[1]
                for name in ("params", "mu", "nu", "main"):
                    if name == "params":
                        local = params
                    elif f"{name}/expert_shard" in files[0]:
                        local = _joined_slices([f[f"{name}/expert_shard"] for f in files], params)
                    else:
                        local = split_experts(_stage_trees(files[0], name))[1]
                        if not tree.tree_leaves(local):
                            continue
                    per_tp.setdefault(name, []).append(local)
            for name, trees in per_tp.items():
                per_ep.setdefault(name, []).append({s: unshard([tr[s] for tr in trees], moe.TP_RULES, "etp")
                                                    for s in trees[0]})
        for name, trees in per_ep.items():
            for s in trees[0]:
                out.setdefault(name, {})[s] = tree.tree_map(lambda *parts: torch.cat(parts), *[tr[s] for tr in trees])
    return out


def _joined_slices(slices: list[torch.Tensor], params: dict[int, Any]) -> dict[int, Any]:
    """A {stage: tree} like params from the distributed optimizer's flat slices of it, in rank order."""
    flat = FlatBuffer.of(params, len(slices))
    return flat.unflatten(torch.cat(slices), tree.tree_map(lambda t: t.float(), params))


def same_layout(meta: dict, layout: dict, config: gpt.GPTConfig) -> bool:
    """Whether this rank's saved shard is what it needs as it is (else full_state reshards)."""
    return meta["layout"] == layout and meta["model"].get("padded_vocab_size") == config.padded_vocab_size


def local_state(path: Path, meta: dict, coords: dict[str, int]) -> tuple[dict[int, Any], dict]:
    """This rank's params and optimizer state, exactly as saved (same layout)."""
    from fmeg.optim import AdamState

    tensors = _with_replicas(path, meta, coords)
    params = _stage_trees(tensors, "params")

    def part(name):
        if f"{name}/shard" in tensors:
            return {k: tensors[f"{name}/{k}"] for k in ("shard", "expert_shard") if f"{name}/{k}" in tensors}
        trees = _stage_trees(tensors, name)
        return trees or None

    state = {"adam": AdamState(tensors["adam/count"], part("mu"), part("nu"))}
    if part("main") is not None:
        state["main"] = part("main")
    return params, state
