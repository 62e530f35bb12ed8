"""The layers a DeepSpeed pipeline stage holds, numbered as DeepSpeed numbers them. Only reads the module; builds,
moves and runs nothing (DeepSpeed 0.19.8 ``runtime/pipe/module.py``)."""
from __future__ import annotations

from typing import List, Optional, Tuple

from torch import nn


def pipeline_stage_layers(model: nn.Module) -> Optional[Tuple[List[Tuple[int, nn.Module]], int]]:
    """For a ``PipelineModule``: ``(index, layer)`` for each layer of its specs this stage built, and how many specs
    the whole pipeline has; None for any other module. ``PipelineModule._build`` registers each built ``LayerSpec``
    (or module) as a child named by its position among all the specs (its parameter names and per-layer checkpoint
    files use it); a ``TiedLayerSpec``'s module lives in ``tied_modules`` instead, and a plain function holds
    nothing."""
    from deepspeed.pipe import PipelineModule

    if not isinstance(model, PipelineModule):
        return None
    layers = [(int(name), child) for name, child in model.named_children() if name.isdigit()]
    return layers, len(model._layer_specs)
