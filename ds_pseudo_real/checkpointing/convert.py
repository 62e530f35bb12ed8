"""Offline checkpoint conversion to any rank count or ZeRO stage: ``ds-pseudo-real convert --input DIR --output DIR
[--to-real]``.

Owns: consolidating a DeepSpeed checkpoint of any ZeRO stage and rank count into full fp32 weights (DeepSpeed's own
``zero_to_fp32`` reader), optionally expanding a pseudo-stage one to the real model's keys, and writing a
"converted" checkpoint that ``load_checkpoint`` accepts on any number of ranks or ZeRO stage, in the stage it holds.
Carries the weights, the step counters, the LR schedule position, the fp16 loss scaler and the plugin state (the stage
and its trigger); Adam moments start at zero (the sharded optimizer layout depends on the rank count; in-process
delinks carry them).
"""
from __future__ import annotations

import argparse
import glob
import os
import sys
import uuid
from pathlib import Path
from typing import Dict, List, Optional

import torch

from ..callbacks import PSEUDO, REAL
from ..sharing import expand_state_dict
from . import folders as ckpt
from . import lock
from .resume import select_resume
from .verify import verify

CLIENT_KEY = ckpt.CLIENT_KEY


def _model_states_file(folder: Path) -> Path:
    files = sorted(glob.glob(str(folder / "*mp_rank_00_model_states.pt")))
    if not files:
        raise FileNotFoundError(f"no DeepSpeed model-states file in {folder}")
    return Path(files[0])


def consolidated_fp32_weights(folder: Path, zero_stage: int, model_states: Dict,
                              swapped: Optional[List[Dict]] = None) -> Dict[str, torch.Tensor]:
    """Full fp32 weights of the unique parameters saved in a DeepSpeed checkpoint folder; ``swapped``: the sidecar's
    ``swapped_state_files`` of a ZeRO-3 checkpoint with the optimizer state on NVMe."""
    if zero_stage == 0:
        return {k: v.float() for k, v in model_states["module"].items()}
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    if swapped is not None:
        from ..ds_state import zero3_fp32_weights_with_swapped_masters

        state = zero3_fp32_weights_with_swapped_masters(str(folder), swapped)
    else:
        state = get_fp32_state_dict_from_zero_checkpoint(str(folder.parent), tag=folder.name)
    state.update(_offload_own_weights(folder, model_states, set(state)))
    return {k: v.float() for k, v in state.items()}


def _saved_loss_scale(folder: Path, model_states: Dict) -> Optional[Dict]:
    """The fp16 loss scaler's state the checkpoint holds: in rank 0's ZeRO optimizer states, or at ZeRO 0 with the
    model states (None without a scaler)."""
    from ..ds_state import saved_loss_scaler_state

    files = sorted(glob.glob(str(folder / "*optim_states.pt")))
    if not files:
        return saved_loss_scaler_state(model_states.get("optimizer"))
    optimizer = torch.load(files[0], map_location="cpu", weights_only=False).get("optimizer_state_dict")
    return saved_loss_scaler_state(optimizer)


def _offload_own_weights(folder: Path, model_states: Dict, known: set) -> Dict[str, torch.Tensor]:
    """Weights of granular offload's host_params groups, which it steps outside DeepSpeed's optimizer (so
    ``zero_to_fp32`` does not see them): their fp32 masters from the optimizer state (the same on every rank),
    else (fp32, where the host params are the master) the module's own values."""
    from ..offload.optimizer_state import OWN_GROUPS_KEY

    files = sorted(glob.glob(str(folder / "*optim_states.pt")))
    if not files:
        return {}
    optimizer = torch.load(files[0], map_location="cpu", weights_only=False).get("optimizer_state_dict", {})
    out = {}
    for group in (optimizer.get("base_optimizer_state") or {}).get(OWN_GROUPS_KEY, []):
        for name, master in zip(group["names"] or [], group["masters"]):
            if name not in known:
                out[name] = master if master is not None else model_states["module"][name]
    return out


def convert(input_dir: str, output_dir: str, tag: Optional[str] = None, to_real: bool = False) -> Path:
    """Write a "converted" checkpoint of ``input_dir/tag`` (default: the newest that verifies) into ``output_dir``
    that loads on any rank count or ZeRO stage, in the stage it was saved in: a run resumed from a pseudo-stage one
    goes on in the pseudo stage and delinks where its config says. ``to_real``: a pseudo-stage one is expanded to
    every layer, and loads as the real model."""
    if tag is None:
        chosen = select_resume(input_dir, move_aside=False)
        if chosen is None:
            raise ckpt.CheckpointError(f"{input_dir} holds no checkpoint to convert")
        tag = chosen[0]
    else:
        verdict = verify(input_dir, tag)
        if not verdict.ok:
            problems = "; ".join(verdict.problems)
            raise ckpt.CheckpointError(f"checkpoint {verdict.folder} cannot be converted: {problems}")
    side = ckpt.read_sidecar(input_dir, tag)
    if side["kind"] == "converted":
        raise ValueError(f"{input_dir}/{tag} is already a converted checkpoint: it loads on any rank count as it is")
    folder = Path(input_dir) / tag
    model_states = torch.load(_model_states_file(folder), map_location="cpu", weights_only=False)
    weights = consolidated_fp32_weights(folder, side["zero_stage"], model_states, side.get("swapped_state_files"))
    plugin = model_states.get(CLIENT_KEY)
    stage = side["stage"]
    if stage == PSEUDO and to_real:
        weights = expand_state_dict(weights, side["layers"], side["num_layers"], side["groups"], clone=True)
        stage = REAL
        if plugin is not None:
            state = dict(plugin["state"], stage=REAL, switch_step=model_states["global_steps"])
            plugin = {"state": state, "callbacks": plugin["callbacks"]}
    trainer = {
        "global_steps": model_states["global_steps"],
        "global_samples": model_states.get("global_samples", 0),
        "skipped_steps": model_states.get("skipped_steps", 0),
        "lr_scheduler": model_states.get("lr_scheduler"),
        "loss_scale": _saved_loss_scale(folder, model_states),
        "client_state": {CLIENT_KEY: plugin} if plugin is not None else {},
    }
    with lock.holding(output_dir):
        refusal = ckpt.foreign_checkpoint(output_dir, tag, ckpt.run_of(side))
        if refusal is not None:
            raise ckpt.CheckpointError(f"not converting {folder}: {refusal}")
        writer = uuid.uuid4().hex[:12]
        staged = Path(output_dir) / ckpt.partial_tag(tag, writer)
        staged.mkdir()
        torch.save(weights, staged / "model_fp32.pt")
        torch.save(trainer, staged / "trainer_state.pt")
        sidecar = dict(side, kind="converted", stage=stage, converted_from=str(folder),
                       written_by=lock.holder_record(output_dir))
        ckpt.publish(output_dir, tag, sidecar, writer=writer)
    return Path(output_dir) / tag


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="ds-pseudo-real convert",
        description="Convert a checkpoint into one that loads on any rank count or ZeRO stage, in the stage it was "
                    "saved in (a pseudo-stage one goes on in the pseudo stage and delinks where configured).",
    )
    parser.add_argument("--input", required=True, help="folder of checkpoints (holds 'latest'), pseudo or real stage")
    parser.add_argument("--output", required=True, help="folder to write the converted checkpoint into")
    parser.add_argument("--tag", default=None, help="checkpoint tag to convert (default: the newest that verifies)")
    parser.add_argument("--to-real", action="store_true",
                        help="expand a pseudo-stage checkpoint to every layer: it loads as the real model")
    args = parser.parse_args(argv)
    if os.path.abspath(args.input) == os.path.abspath(args.output):
        parser.error("--output must differ from --input")
    out = convert(args.input, args.output, args.tag, args.to_real)
    print(f"wrote {ckpt.read_sidecar(str(out.parent), out.name)['stage']}-stage checkpoint {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
