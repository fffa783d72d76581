"""What this machine's CPU is: one reader of ``/proc/cpuinfo`` for every place that names or keys on the CPU.

Cache keys need more than the marketing name: one name ("AMD EPYC") covers Zen 3, Zen 4 and Zen 5, which price a
multi-row step differently, so :func:`cpu_identity` adds the family and model numbers. Off Linux (no
``/proc/cpuinfo``) the fields are empty and the name falls back to ``platform.processor()``.
"""

from __future__ import annotations

import functools
import platform


@functools.lru_cache(maxsize=1)
def cpu_fields() -> dict[str, str]:
    """The first processor's ``key: value`` lines of ``/proc/cpuinfo`` (every processor of a machine is alike for
    what laserlm reads); ``{}`` where the file cannot be read."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if not line.strip():
                    break  # the end of the first processor's record
                key, _, value = line.partition(":")
                fields[key.strip()] = value.strip()
    except OSError:
        pass
    return fields


def cpu_name() -> str:
    """The CPU's model name (``model name`` in ``/proc/cpuinfo``), else ``platform.processor()`` or the machine type."""
    return cpu_fields().get("model name") or platform.processor() or platform.machine()


def cpu_identity() -> str:
    """The model name with its family and model numbers, e.g. ``"AMD EPYC family 25 model 17"`` (Zen 4): what a
    cached per-machine measurement or tuning is keyed by."""
    f = cpu_fields()
    return f"{cpu_name()} family {f.get('cpu family', '?')} model {f.get('model', '?')}"


def cpu_flags() -> str:
    """The ``flags`` line (instruction-set extensions), else the model name: what a compiled kernel depends on."""
    return cpu_fields().get("flags") or cpu_name()
