"""Trial sandboxing: run a command in a memory cgroup limited to the budget (page cache counts).

Only the tuner uses it (a trial is `colibri bench` in a child process); the engine never does.
"""

from tuner.sandbox.cgroups import CgroupSupport, current_memory_limit, detect_memory_cgroup
from tuner.sandbox.limited import LimitedProcess, LimitedRun, run_limited

__all__ = ["CgroupSupport", "LimitedProcess", "LimitedRun", "current_memory_limit", "detect_memory_cgroup", "run_limited"]
