"""What each MoE strategy does, as data the runtime reads instead of comparing names.

    fused    every expert resident in its own slot: nothing to decide
    offload  a device cache; every miss copied in                      (decided on the device)
    hybrid   a device cache; misses split between copies and the CPU   (decided on the device)
    static   a placement fixed at load; every miss on the CPU (llama.cpp's --n-cpu-moe)
    cpu      no device cache; every route on the CPU

Each strategy also chooses its parts: here the miss split of the calls the host decides
(moe/split.py); the runtime's build adds the step clock (moe/steps.py) and the CPU share of
device-decided calls (moe/cpu_share.py) from `splits` and what the machine offers.

The names are config.py's STRATEGIES (the one list of them, which the CLI offers); `auto` is
not one of these: it resolves to one at load (moe/runtime.py `resolve_strategy`).
"""

from __future__ import annotations

from dataclasses import dataclass

from freetoken.moe.split import BandwidthSplit, FillEvery, MissSplit


@dataclass(frozen=True)
class Strategy:
    name: str
    resident: bool = False  # every expert in its own slot (slot == flat id)
    cached: bool = True  # a device cache of experts
    fills: bool = False  # misses are copied into the cache
    splits: bool = False  # misses shared with the CPU by the measured split (StepModes too)
    fixed_placement: bool = False  # the cache's contents chosen at load and kept
    on_device: bool = False  # decode calls can be decided on the device (device control)
    miss_split: type[MissSplit] = MissSplit  # which misses the host fills (MissSplit: none)


# What each of config.STRATEGIES but `auto` does, by name.
KINDS = {
    s.name: s
    for s in (
        Strategy("fused", resident=True),
        Strategy("offload", fills=True, on_device=True, miss_split=FillEvery),
        Strategy("hybrid", fills=True, splits=True, on_device=True, miss_split=BandwidthSplit),
        Strategy("static", fixed_placement=True),
        Strategy("cpu", cached=False),
    )
}
