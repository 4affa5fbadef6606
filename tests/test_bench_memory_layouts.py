"""benchmarks/time/memory_layouts.py: the random memory layout each paired child starts with."""

import random

from benchmarks.time import memory_layouts as layouts


def test_a_seed_gives_the_same_buffers_and_another_seed_others(monkeypatch):
    """A layout is its seed: the same seed allocates the same buffers (a run can be replayed), another seed
    other sizes or counts (another layout); and they stay alive, or the allocator would hand their
    addresses straight back."""
    monkeypatch.setattr(layouts, "_kept", [])
    assert layouts.shift_layout(7) == 7
    first = [len(b) if isinstance(b, bytearray) else b.numel() for b in layouts._kept]
    assert len(first) >= 2
    layouts._kept.clear()
    layouts.shift_layout(7)
    assert [len(b) if isinstance(b, bytearray) else b.numel() for b in layouts._kept] == first
    layouts._kept.clear()
    layouts.shift_layout(8)
    assert [len(b) if isinstance(b, bytearray) else b.numel() for b in layouts._kept] != first


def test_a_child_takes_its_layout_from_the_environment_the_parent_gave(monkeypatch):
    """The parent's entry (a seed, and a padding whose length moves the child's stack) is what the child's
    shift_layout reads; without it the child allocates nothing."""
    monkeypatch.setattr(layouts, "_kept", [])
    monkeypatch.delenv(layouts.LAYOUT_ENV, raising=False)
    assert layouts.shift_layout() is None and layouts._kept == []
    env = layouts.layout_env(random.Random(3))
    seed, pad = env[layouts.LAYOUT_ENV].split(":", 1)
    assert set(pad) <= {"."} and len(pad) < layouts.STACK_PAD
    monkeypatch.setenv(layouts.LAYOUT_ENV, env[layouts.LAYOUT_ENV])
    assert layouts.shift_layout() == int(seed) and layouts._kept
    pads = {len(layouts.layout_env(random.Random(s))[layouts.LAYOUT_ENV]) for s in range(20)}
    assert len(pads) > 1  # the padding varies from child to child


def test_each_child_of_a_random_run_gets_a_layout_of_its_own_and_a_fixed_run_none():
    """What draft_runs gives each child it starts: its environment plus a fresh layout with --layouts random
    (no two children alike), and no layout at all with --layouts fixed, not even one inherited."""
    rng = random.Random(5)
    base = {"PATH": "/usr/bin", layouts.LAYOUT_ENV: "1:..."}
    envs = [layouts.child_env(base, "random", rng) for _ in range(4)]
    assert all(e["PATH"] == "/usr/bin" for e in envs)
    assert len({e[layouts.LAYOUT_ENV] for e in envs} | {base[layouts.LAYOUT_ENV]}) == 5
    fixed = layouts.child_env(base, "fixed", rng)
    assert fixed == {"PATH": "/usr/bin"}
    assert base[layouts.LAYOUT_ENV] == "1:..."  # (the parent's own environment untouched)
