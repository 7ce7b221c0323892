"""A parallel layout: how a model is split over GPUs (shared by launch/, train/ and the model builder)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int = 1
    vpp: int | None = None
    sequence_parallel: bool = False

    def model_parallel(self) -> int:
        return self.tp * self.pp * self.cp

    def dp(self, world: int) -> int:
        return world // self.model_parallel()

    def __str__(self) -> str:
        parts = [f"TP{self.tp}", f"PP{self.pp}"]
        if self.vpp:
            parts.append(f"VPP{self.vpp}")
        if self.cp > 1:
            parts.append(f"CP{self.cp}")
        if self.ep > 1:
            parts.append(f"EP{self.ep}")
        if self.etp > 1:
            parts.append(f"ETP{self.etp}")
        return "x".join(parts)
