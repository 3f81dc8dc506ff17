"""Attribute a profiled step's GPU kernel time to the source lines that produced each kernel.

XLA keeps, on every instruction of the optimized HLO, the JAX op name and the Python source line that traced it
(`metadata={op_name="jit(step)/..." source_file="..." source_line=N}`). A jax.profiler trace names each kernel's
HLO instruction (its `hlo_op` argument; a fusion's kernel is also named after the fusion). Joining the two gives
kernel time per source line: "which line of the optimizer costs 40 ms" rather than "loop_multiply_fusion_12".

    from hlo_attribution import instruction_sources, attribute
    sources = instruction_sources(open("module_0001.jit_step.sm_9.0_gpu_after_optimizations.txt").read())
    report = attribute(kernel_events, sources, steps)      # kernel_events: the trace's GPU "X" events

profile_step.py --attribute does both (it dumps the optimized HLO with --xla_dump_to and prints the table).
"""
from __future__ import annotations

import collections
import re

_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=.*?metadata=\{([^}]*)\}", re.M)
_FIELD = re.compile(r'(\w+)=("(?:[^"\\]|\\.)*"|\S+)')
_TABLE_ROW = re.compile(r'^(\d+) (?:"(.*)"|\{(.*)\})$')


def _fields(meta: str) -> dict[str, str]:
    return {k: v.strip('"') for k, v in _FIELD.findall(meta)}


def _tables(hlo_text: str) -> dict[str, dict[int, object]]:
    """The module header's FileNames / FunctionNames / FileLocations / StackFrames tables (newer XLA: an
    instruction's metadata names a stack_frame_id instead of source_file / source_line)."""
    tables: dict[str, dict[int, object]] = {}
    current = None
    for line in hlo_text.splitlines():
        line = line.strip()
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            current = tables.setdefault(line, {})
            continue
        if line.startswith("%") or line.startswith("ENTRY") or line.startswith("ROOT"):
            break
        m = _TABLE_ROW.match(line) if current is not None else None
        if m:
            current[int(m.group(1))] = m.group(2) if m.group(2) is not None else _fields(m.group(3))
        elif line:
            current = None
    return tables


def _frames(tables) -> dict[int, list[str]]:
    """{stack_frame_id: ["file:line function", caller's, ...]} (innermost first, at most 4)."""
    files, funcs = tables.get("FileNames", {}), tables.get("FunctionNames", {})
    locs, frames = tables.get("FileLocations", {}), tables.get("StackFrames", {})

    def where(frame_id: int) -> str:
        loc = locs.get(int(frames[frame_id]["file_location_id"]), {})
        f = str(files.get(int(loc.get("file_name_id", 0)), "?")).rsplit("/", 1)[-1]
        return f"{f}:{loc.get('line', '?')} {funcs.get(int(loc.get('function_name_id', 0)), '?')}"

    out = {}
    for fid in frames:
        chain, seen, cur = [], set(), fid
        while cur in frames and cur not in seen and len(chain) < 4:
            seen.add(cur)
            chain.append(where(cur))
            # printed one above the caller's id (0: none), as XLA's text dump writes it (checked on a 2-frame stack)
            cur = int(frames[cur].get("parent_frame_id", 0)) - 1
        out[fid] = chain
    return out


def instruction_sources(hlo_text: str) -> dict[str, tuple[str, str]]:
    """{instruction name: (source "file:line function", context)} for every instruction of an HLO text dump that
    has metadata; context = the callers (newer XLA's stack frames) and the op_name. Names are stored as written
    (`fusion.12`) and with '.' -> '_' (`fusion_12`, a kernel's name)."""
    frames = _frames(_tables(hlo_text))
    out: dict[str, tuple[str, str]] = {}
    for m in _INSTR.finditer(hlo_text):
        name, meta = m.group(1), _fields(m.group(2))
        op = meta.get("op_name", "")
        chain = frames.get(int(meta["stack_frame_id"]), []) if meta.get("stack_frame_id", "").isdigit() else []
        if chain:
            entry = (chain[0], " < ".join(chain[1:3]) + " | " + op)
        else:
            entry = (meta.get("source_file", "?").rsplit("/", 1)[-1] + ":" + meta.get("source_line", "?"), op)
        out[name] = entry
        out.setdefault(name.replace(".", "_"), entry)
    return out


def kernel_source(event: dict, sources: dict[str, tuple[str, str]]) -> tuple[str, str] | None:
    """The (source line, op_name) of one trace event: by its hlo_op argument, else by its kernel name."""
    args = event.get("args", {}) or {}
    for key in ("hlo_op", "tf_op", "long_name"):
        v = args.get(key)
        if isinstance(v, str):
            v = v.split(":")[0].strip().lstrip("%")
            if v in sources:
                return sources[v]
    name = event.get("name", "")
    return sources.get(name) or sources.get(name.replace(".", "_"))


def attribute(events: list[dict], sources: dict[str, tuple[str, str]], steps: int, top: int = 45) -> str:
    """A text report: kernel ms per step by source file, and by source line (the `top` costliest), with each
    line's kernel count and one op_name."""
    by_line, by_file, ops, counts = collections.Counter(), collections.Counter(), {}, collections.Counter()
    unmatched, total = collections.Counter(), 0.0
    for e in events:
        d = float(e["dur"]) / steps
        total += d
        src = kernel_source(e, sources)
        if src is None:
            unmatched[e.get("name", "?")[:60]] += d
            continue
        by_line[src[0]] += d
        by_file[src[0].split(":", 1)[0]] += d
        counts[src[0]] += 1
        ops.setdefault(src[0], src[1])
    lines = [f"kernel time by source ({total / 1e3:.1f} ms per step; unmatched "
             f"{sum(unmatched.values()) / 1e3:.1f} ms)"]
    for f, d in by_file.most_common(20):
        lines.append(f"  {d / 1e3:8.2f} ms  {f}")
    lines.append("by source line (ms per step, kernels per step, one op_name):")
    for src, d in by_line.most_common(top):
        lines.append(f"  {d / 1e3:8.2f}  {counts[src] // max(steps, 1):5d}  {src:40s} {ops[src][-140:]}")
    if unmatched:
        lines.append("unmatched kernels: " + ", ".join(f"{n} {d / 1e3:.1f} ms" for n, d in unmatched.most_common(8)))
    return "\n".join(lines)


__all__ = ["instruction_sources", "kernel_source", "attribute"]
