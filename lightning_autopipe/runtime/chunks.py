"""Several chunks of the model held by one rank, as one module (interleaved and V placement).

A rank that holds chunks ``c1 < c2 < ...`` binds the user's module to all of them at once
(:func:`~lightning_autopipe.runtime.local_stage.bind_local_stage` reads one ``param_names``),
moves and counts their parameters together, and hands the executor one module per chunk.
Chunks built from one :class:`~lightning_autopipe.graph.BlockGraph` share the Parameter
objects of the model, so a weight two local chunks use (GPT's embedding and tied head, both
on rank 0 in V placement) is one Parameter here: one gradient, one optimizer entry, and no
tie group to sum copies over.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn

from lightning_autopipe.errors import PipelineRuntimeError
from lightning_autopipe.runtime.groups import RankLayout

__all__ = ["RankChunks", "chunk_modules"]


class RankChunks(nn.Module):
    """Chunk index -> the chunk's module; submodule ``str(c)`` is chunk ``c``.

    Its ``state_dict`` keys are ``"<chunk>.<the chunk's key>"`` and :attr:`param_names` maps
    them to the original model's names (a weight shared by two chunks appears under both
    keys, one object).
    """

    def __init__(self, chunks: Mapping[int, nn.Module]) -> None:
        super().__init__()
        self.parts = nn.ModuleDict({str(c): chunks[c] for c in sorted(chunks)})

    @property
    def chunks(self) -> dict[int, nn.Module]:
        """Chunk index -> module, in model order."""
        return {int(c): m for c, m in self.parts.items()}

    @property
    def param_names(self) -> dict[str, str]:
        """This module's ``state_dict`` key -> the original model's name (graph-layer chunks
        carry ``param_names``; another module's keys are taken as original)."""
        out: dict[str, str] = {}
        for c, mod in self.parts.items():
            names = getattr(mod, "param_names", None)
            for key in mod.state_dict(keep_vars=True):
                out[f"parts.{c}.{key}"] = names.get(key, key) if names is not None else key
        return out

    def forward(self, *args: object) -> object:
        raise TypeError(
            "RankChunks holds several chunks of the pipeline; run each chunk's module "
            "(RankChunks.chunks[c]) through the executor"
        )


def chunk_modules(
    stage: nn.Module | Mapping[int, nn.Module], layout: RankLayout
) -> dict[int, nn.Module]:
    """Chunk index -> module of this rank; a single module is the rank's one chunk."""
    held = layout.chunks
    if isinstance(stage, nn.Module):
        if len(held) != 1:
            raise PipelineRuntimeError(
                f"rank {layout.rank} holds chunks {list(held)} of the plan but the executor got "
                "one module; give a mapping chunk -> module"
            )
        return {held[0]: stage}
    mods = {int(c): m for c, m in stage.items()}
    if sorted(mods) != list(held):
        raise PipelineRuntimeError(
            f"rank {layout.rank} holds chunks {list(held)} of the plan but the executor got "
            f"modules for chunks {sorted(mods)}"
        )
    return dict(sorted(mods.items()))
