"""Streaming DiLoCo's fragments (Douillard et al. 2025, docs/streaming.md): the model split into P parts synced one at
a time on a staggered schedule, so that no round moves the whole model.

Round r (H / P inner steps) syncs fragment r mod P: each worker publishes the pseudo-gradient of that fragment only,
the coordinator applies the outer step to it (its own momentum, per piece) and commits θ_{r+1}, which differs from
θ_r in that fragment only. Fragment p is therefore synced every P rounds = every H inner steps, staggered by H/P
(the first time after (p + 1)·H/P steps, as torchft's schedule).

The split is the paper's strided one over the transformer blocks: fragment p holds blocks p, p + P, p + 2P, ...
Tensors outside the blocks are assigned explicitly:
  - 2-D ones (the token embeddings, which a tied head shares; an untied head; position embeddings) are split by
    rows into P near-equal ranges, fragment p syncing range p: the embeddings of a small model are a large share of
    it (a third of the 4-block default), and whole they would make one fragment's sync twice the others';
  - 1-D ones (the final norm) go with fragment P − 1, the last block's when P divides the number of blocks.
A piece is a whole tensor (its name) or a row range of one ("model.embed_tokens.weight[0:512]"): the unit of the
fragment's files (deltas, updates), of the outer momentum and of the error-feedback residual.
"""
from __future__ import annotations

import re
from collections.abc import Mapping

import torch

from train.core.errors import ConfigError

# the index of the transformer block a parameter belongs to: Llama / Mistral / Qwen (model.layers.i.), GPT-2
# (transformer.h.i.), BERT-like (layer.i.), others (blocks.i.)
BLOCK = re.compile(r"(?:^|\.)(?:layers|h|layer|blocks)\.(\d+)\.")
PIECE = re.compile(r"^(.*)\[(\d+):(\d+)\]$")


def block_of(name: str) -> int | None:
    m = BLOCK.search(name)
    return int(m.group(1)) if m else None


class Fragments:
    """The pieces of every fragment of the global model, and which round syncs which."""

    def __init__(self, shapes: Mapping[str, tuple], P: int):
        self.P, self.full_shapes = P, dict(shapes)
        names = list(shapes)
        blocks = [b for b in map(block_of, names) if b is not None]
        self.n_blocks = max(blocks) + 1 if blocks else 0
        if P > 1 and P > self.n_blocks:
            what = f"{self.n_blocks} transformer blocks" if self.n_blocks else "no transformer blocks (model.layers.N.)"
            raise ConfigError(f"outer.fragments = {P}: the model has {what}, and each fragment needs at least one "
                              f"(the strided split: fragment p holds blocks p, p + P, ...); use outer.fragments <= "
                              f"{max(1, self.n_blocks)}")
        self._pieces: list[list[str]] = [[] for _ in range(P)]
        self._where: dict[str, tuple[str, int, int] | None] = {}  # piece -> (tensor, first row, end row) or None
        for n in names:
            shape, b = tuple(shapes[n]), block_of(n)
            if P == 1 or b is not None:
                self._add(0 if P == 1 else b % P, n, None)
            elif len(shape) == 2 and shape[0] >= P:
                rows = shape[0]
                for p in range(P):
                    a, e = p * rows // P, (p + 1) * rows // P
                    self._add(p, f"{n}[{a}:{e}]", (n, a, e))
            else:
                self._add(P - 1, n, None)
        self._shapes = {piece: self._shape(piece) for p in self._pieces for piece in p}

    def _add(self, p: int, piece: str, where) -> None:
        self._pieces[p].append(piece)
        self._where[piece] = where

    def _shape(self, piece: str) -> tuple:
        w = self._where[piece]
        if w is None:
            return tuple(self.full_shapes[piece])
        n, a, e = w
        return (e - a, *self.full_shapes[n][1:])

    # -- the schedule ---------------------------------------------------------------------------------------------
    def of_round(self, r: int) -> int:
        """The fragment round r syncs."""
        return r % self.P

    def pieces(self, r: int) -> list[str]:
        """The pieces round r syncs, in the global file's order (every tensor, whole, with P = 1)."""
        return self._pieces[self.of_round(r)]

    def shapes(self, r: int) -> dict[str, tuple]:
        return {k: self._shapes[k] for k in self.pieces(r)}

    # -- pieces of a {name: tensor} -------------------------------------------------------------------------------
    def get(self, tensors: Mapping[str, torch.Tensor], piece: str) -> torch.Tensor:
        """The piece of `tensors` (a view: writing into it writes into the tensor)."""
        w = self._where[piece]
        return tensors[piece] if w is None else tensors[w[0]][w[1]:w[2]]

    def view(self, r: int, tensors: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
        """{piece: view} of round r's pieces (the mapping itself with P = 1)."""
        if self.P == 1:
            return tensors
        return {k: self.get(tensors, k) for k in self.pieces(r)}

    def put(self, tensors: dict[str, torch.Tensor], piece: str, value: torch.Tensor) -> None:
        """tensors[piece] = value, never writing into a tensor someone may hold: a row range goes into a copy."""
        w = self._where[piece]
        if w is None:
            tensors[piece] = value
            return
        full = tensors[w[0]].clone()
        full[w[1]:w[2]] = value
        tensors[w[0]] = full

    # -- for people -----------------------------------------------------------------------------------------------
    def numel(self, p: int) -> int:
        return sum(int(torch.Size(self._shapes[k]).numel()) for k in self._pieces[p])

    def describe(self) -> str:
        """What each fragment holds and its share of the parameters (the start-up log)."""
        total = sum(self.numel(p) for p in range(self.P))
        out = []
        for p in range(self.P):
            blocks = sorted({b for k in self._pieces[p] if (b := block_of(k)) is not None})
            other = [k for k in self._pieces[p] if block_of(k) is None]
            out.append(f"fragment {p}: blocks {', '.join(map(str, blocks))}{' + ' + ', '.join(other) if other else ''}"
                       f" ({100 * self.numel(p) / max(1, total):.1f}%)")
        return "; ".join(out)

