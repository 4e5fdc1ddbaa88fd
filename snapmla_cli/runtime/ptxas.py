"""Parse ptxas' ``-v`` resource report out of an NVRTC log.

Why: register count, spills and stack frames decide whether a kernel runs at its intended
occupancy; the compile tests fail on any spill or stack frame, and ``snapmla info`` / the tuner
report registers and shared memory. ptxas prints, per function::

    ptxas info    : Compiling entry function 'k' for 'sm_90a'
    ptxas info    : Function properties for k
    ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
    ptxas info    : Used 40 registers, used 1 barriers, 1024 bytes smem, 392 bytes cmem[0]

Non-entry functions (``__noinline__`` callees) get only the "Function properties" and stack
lines; they are reported too, with ``is_entry=False``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

_ENTRY = re.compile(r"Compiling entry function '([^']+)' for '([^']+)'")
_PROPS = re.compile(r"Function properties for (\S+)")
_STACK = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers")
_ITEM = re.compile(r"(\d+) bytes (smem|lmem|cumulative stack size|cmem\[(\d+)\])")
_BARRIERS = re.compile(r"used (\d+) barriers")
_SPILL_WARNING = re.compile(
    r"Registers are spilled to local memory in function '([^']+)', "
    r"(\d+) bytes spill stores, (\d+) bytes spill loads"
)


@dataclass(frozen=True)
class KernelResources:
    """What ptxas reported for one function (bytes unless named otherwise)."""

    name: str
    arch: str = ""
    is_entry: bool = False
    registers: int = 0
    barriers: int = 0
    shared_bytes: int = 0  # static shared memory ("smem")
    const0_bytes: int = 0  # cmem[0]: kernel parameters and constants
    local_bytes: int = 0  # "lmem" (older ptxas) or cumulative stack size
    stack_frame_bytes: int = 0
    spill_store_bytes: int = 0
    spill_load_bytes: int = 0

    @property
    def spills(self) -> bool:
        return self.spill_store_bytes > 0 or self.spill_load_bytes > 0

    @property
    def clean(self) -> bool:
        """No spills and no stack frame: the kernel keeps everything in registers."""
        return not self.spills and self.stack_frame_bytes == 0 and self.local_bytes == 0

    def summary(self) -> str:
        return (
            f"{self.name} [{self.arch}]: {self.registers} regs, {self.shared_bytes} B smem, "
            f"{self.stack_frame_bytes} B stack, spill {self.spill_store_bytes}/"
            f"{self.spill_load_bytes} B st/ld"
        )


def parse_ptxas_log(log: str) -> dict[str, KernelResources]:
    """Every function ptxas reported on, by (mangled) name, in the order first seen."""
    out: dict[str, KernelResources] = {}
    entry: str | None = None  # the entry function whose "Used ..." line comes next
    props: str | None = None  # the function whose stack line comes next

    def get(name: str) -> KernelResources:
        if name not in out:
            out[name] = KernelResources(name=name)
        return out[name]

    for line in log.splitlines():
        m = _ENTRY.search(line)
        if m:
            entry = m.group(1)
            out[entry] = replace(get(entry), arch=m.group(2), is_entry=True)
            continue
        m = _PROPS.search(line)
        if m:
            props = m.group(1)
            get(props)
            continue
        m = _STACK.search(line)
        if m and props is not None:
            out[props] = replace(
                out[props],
                stack_frame_bytes=int(m.group(1)),
                spill_store_bytes=int(m.group(2)),
                spill_load_bytes=int(m.group(3)),
            )
            props = None
            continue
        m = _USED.search(line)
        if m and entry is not None:
            out[entry] = _apply_used_line(out[entry], line, int(m.group(1)))
            entry = None
            continue
        m = _SPILL_WARNING.search(line)
        if m:
            name = m.group(1)
            res = get(name)
            out[name] = replace(
                res,
                spill_store_bytes=max(res.spill_store_bytes, int(m.group(2))),
                spill_load_bytes=max(res.spill_load_bytes, int(m.group(3))),
            )
    return out


def _apply_used_line(res: KernelResources, line: str, registers: int) -> KernelResources:
    barriers, shared, const0 = res.barriers, res.shared_bytes, res.const0_bytes
    local_sizes: list[int] = []  # "lmem" / cumulative stack sizes on this line
    b = _BARRIERS.search(line)
    if b:
        barriers = int(b.group(1))
    for m in _ITEM.finditer(line):
        value, kind = int(m.group(1)), m.group(2)
        if kind == "smem":
            shared = value
        elif kind in ("lmem", "cumulative stack size"):
            local_sizes.append(value)
        elif m.group(3) == "0":
            const0 = value
    return replace(res, registers=registers, barriers=barriers, shared_bytes=shared,
                   local_bytes=max(local_sizes, default=res.local_bytes), const0_bytes=const0)
