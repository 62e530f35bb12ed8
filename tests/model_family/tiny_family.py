"""A model family of the main job in one file, as a user's package would add one: its section (``"tiny"`` in the
config), its spec, its model and its row of the docs table, registered with ``ds_pseudo_real.models.registry``.
The package declares this module in its metadata (entry point group ``ds_pseudo_real.model_families``); nothing else
of the project knows of it."""
from typing import ClassVar

from torch import nn

from ds_pseudo_real.config import ConfigError
from ds_pseudo_real.models.registry import ModelFamily, ModelSpec, register
from ds_pseudo_real.models.sections import ModelSection, count


class TinySection(ModelSection):
    kind: ClassVar[str] = "tiny"
    n_layer: int = count(4)
    width: int = count(16)
    seq_len: int = count(16)


class TinyLM(nn.Module):
    """Embedding, a stack of residual MLP layers at ``layers``, a head; ``forward(idx, targets)`` -> loss."""

    def __init__(self, vocab_size: int, n_layer: int, width: int):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, width)
        self.layers = nn.ModuleList(nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width), nn.GELU())
                                    for _ in range(n_layer))
        self.head = nn.Linear(width, vocab_size)

    def forward(self, idx, targets=None):
        h = self.embed(idx)
        for layer in self.layers:
            h = h + layer(h)
        logits = self.head(h)
        if targets is None:
            return logits
        return nn.functional.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))


def tiny_spec(section, flags, vocab_size, world_size, eod):
    if section.width % 4:
        raise ConfigError(f"tiny.width: got {section.width}; a multiple of 4 is accepted")
    return ModelSpec("tiny", section.n_layer, flags.get("seq_len") or section.seq_len, vocab_size,
                     options={"n_layer": section.n_layer, "width": section.width})


def parameter_total(spec):
    width, vocab = spec.options["width"], spec.vocab_size
    return vocab * width + spec.num_layers * (2 * width + width * width + width) + width * vocab + vocab


FAMILY = register(ModelFamily(
    section=TinySection, spec=tiny_spec, parameter_total=parameter_total,
    build=lambda spec, seed: TinyLM(spec.vocab_size, spec.num_layers, spec.options["width"]),
    docs_row='| `"tiny": {"n_layer", "width", "seq_len"}` | a residual MLP stack (a test\'s family) |'))
