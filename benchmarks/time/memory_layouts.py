"""Randomized memory layouts for paired timing (a helper of draft_decode.py, not a command).

Why: where a process's buffers lie relative to each other (the stack's start, the malloc heap's
offsets, torch's allocations) moves a decode step by a few percent, and it is set by everything the
process allocated before: the same code with one more object built at start-up runs at another pace,
run after run, however many rounds or processes measure it (Mytkowicz et al., "Producing wrong data
without doing anything obviously wrong!", ASPLOS 2009; Curtsinger and Berger's Stabilizer, ASPLOS
2013, randomizes layouts for that reason). A drafting engine builds more objects than `off` before
it decodes, so with one layout per build a row compares two draws of that luck, however many
processes take it. Measured on the MTP reference under 400 MiB (2026-12-07, four processes a mode,
docs/BENCHMARKS.md "Random memory layouts"), the randomization changed nothing that the runs' spread
shows: the gated-off MTP engine's code row was 0.953x with random layouts and 1.005x with fixed ones,
in consecutive runs. It is kept as the default because it can only take a bias out, at no cost.

Each child a paired run starts gets its own random layout: a padding in its environment (the
environment's strings sit at the top of the stack, so its length moves where the stack starts) and a
seed; `shift_layout` then allocates and keeps a seeded number of small buffers of seeded sizes (the
malloc heap's and torch's allocator's next addresses move) before the engine is built. A mode's N
processes then draw N layouts, as they draw N paces. The buffers are at most ~1.2 MiB, outside the
memory plan, inside the cgroup's headroom (a child under 400 MiB uses ~200 MiB of it).
"""

from __future__ import annotations

import os
import random

LAYOUT_ENV = "COLIBRI_BENCH_LAYOUT"  # "<seed>:<padding>"
STACK_PAD = 4096  # the environment padding's length: 0..this many bytes (a page of stack offsets)
_kept: list = []  # the buffers shift_layout allocated: alive until the process ends


def layout_env(rng: random.Random) -> dict[str, str]:
    """The environment entry that gives a child a random layout (shift_layout reads its seed)."""
    return {LAYOUT_ENV: f"{rng.randrange(1 << 31)}:" + "." * rng.randrange(STACK_PAD)}


def child_env(base, layouts: str, rng: random.Random) -> dict[str, str]:
    """A child's environment: `base` with a random layout of its own (layouts "random"), or with none
    (layouts "fixed": not even one this process inherited)."""
    env = {k: v for k, v in base.items() if k != LAYOUT_ENV}
    if layouts == "random":
        env.update(layout_env(rng))
    return env


def shift_layout(seed: int | None = None) -> int | None:
    """Allocate (and keep) a seeded number of small buffers of seeded sizes: the seed given, else the
    one in LAYOUT_ENV, else nothing → the seed used, or None. Python buffers (malloc's heap: up to 63
    of 16 B-4 KiB) and torch tensors (torch's CPU allocator: up to 15 of 16 B-64 KiB)."""
    if seed is None:
        value = os.environ.get(LAYOUT_ENV)
        if not value:
            return None
        seed = int(value.split(":", 1)[0])
    import torch
    rng = random.Random(seed)
    _kept.extend(bytearray(rng.randrange(16, 4096)) for _ in range(rng.randrange(1, 64)))
    _kept.extend(torch.empty(rng.randrange(16, 65536), dtype=torch.uint8) for _ in range(rng.randrange(1, 16)))
    return seed
