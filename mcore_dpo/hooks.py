"""Named points of a rank's work where other code can be called: empty in every normal run.

    hooks.fire("train_step", step=3, rank=0, output_dir="out")   # in the worker
    hooks.register("train_step", callback)                        # by whoever wants to watch

The reliability tests fill them (tests/fault_hooks/) to kill or stall a rank at an exact moment.
Points: "train_step" (start of a step) and "save_checkpoint" (start of a checkpoint write),
each called with keyword arguments step, rank and output_dir.
"""

from __future__ import annotations

from collections.abc import Callable

POINTS = ("train_step", "save_checkpoint")
_callbacks: dict[str, list[Callable[..., None]]] = {point: [] for point in POINTS}


def register(point: str, callback: Callable[..., None]) -> None:
    if point not in _callbacks:
        raise ValueError(f"unknown hook point {point!r}; known: {', '.join(POINTS)}")
    _callbacks[point].append(callback)


def clear() -> None:
    for callbacks in _callbacks.values():
        callbacks.clear()


def fire(point: str, **info) -> None:
    for callback in _callbacks[point]:
        callback(**info)
