"""The layers granular offload places on this rank and their numbers in plans and configs: the model's layer list,
or the layers of a DeepSpeed pipeline stage. Must not plan or place."""
from __future__ import annotations

from typing import List, Tuple

from torch import nn

from ds_pseudo_real.ds_state import pipeline_stage_layers
from ds_pseudo_real.sharing import get_layer_list


def rank_layers(model: nn.Module, layer_path: str) -> Tuple[List[Tuple[int, nn.Module]], int]:
    """``(index, layer)`` for each layer this rank holds, and how many layers the whole model has.

    A DeepSpeed ``PipelineModule`` holds its stage's layers only, numbered as DeepSpeed numbers them (the position
    of their spec among all the pipeline's specs; ``layer_path`` is not read; a tied module the stage calls is the
    layer at each of its positions, its parameters planned with the first): a pipeline stage plans and offloads
    its own layers, and one config names every stage's. Any other model holds the whole layer list at
    ``layer_path`` (under tensor parallelism, this rank's slices of it)."""
    stage = pipeline_stage_layers(model)
    if stage is not None:
        return stage
    layers = get_layer_list(model, layer_path)
    return list(enumerate(layers)), len(layers)
