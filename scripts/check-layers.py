#!/usr/bin/env python3
"""Checks the shape of the workspace, as `make test` does:

1. Crates along their layers: each crate depends only on crates below it (from its
   Cargo.toml's [dependencies]):

       freight-proto                   the protocol without I/O
       freight-host                    the machine: identity, cores, NICs, PCI
       freight-cuda                    GPUs, loaded at run time
       freight-core                    the engine (agents, memory, peers, transports)
       freight-stream, -kv, -ep        the products on the engine
       freight-cache                   the KV cache engine (its remote tier: a stream)
       freight-bench                   the benchmark programs
       freight-cli                     the `freight` command
       freight-py, freight-fuzz        the Python bindings, the fuzz targets

2. freight-proto has no sockets, threads, clocks, files or processes outside its tests.

3. No crate has an import cycle among its modules: a module that uses another is never
   used by it, directly or around a loop (a module and those nested in it count as one
   where they refer to each other).

Prints what it found wrong and exits 1, or one line and exits 0.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CRATES = ROOT / "crates"

# Each crate and the freight crates it may depend on.
ALLOWED = {
    "freight-proto": set(),
    "freight-host": {"freight-proto"},
    "freight-cuda": {"freight-proto", "freight-host"},
    "freight-core": {"freight-proto", "freight-host", "freight-cuda"},
    "freight-stream": {"freight-proto", "freight-host", "freight-cuda", "freight-core"},
    # The cache's remote tier is a store over a stream.
    "freight-cache": {"freight-proto", "freight-host", "freight-cuda", "freight-core", "freight-stream"},
    "freight-kv": {"freight-proto", "freight-host", "freight-cuda", "freight-core"},
    "freight-ep": {"freight-proto", "freight-host", "freight-cuda", "freight-core"},
}
PRODUCTS = {"freight-stream", "freight-cache", "freight-kv", "freight-ep"}
ALLOWED["freight-bench"] = set(ALLOWED["freight-core"]) | {"freight-core"} | PRODUCTS
ALLOWED["freight-cli"] = ALLOWED["freight-bench"] | {"freight-bench"}
ALLOWED["freight-py"] = ALLOWED["freight-cli"] | {"freight-cli"}
ALLOWED["freight-fuzz"] = ALLOWED["freight-bench"]

# What the protocol crate must not touch outside its tests: it is driven by its callers.
NO_IO = [
    # (Addresses are plain values: std::net::SocketAddr is parsed, never resolved.)
    (r"\bTcpStream\b|\bUdpSocket\b|\bTcpListener\b|\bToSocketAddrs\b|\bto_socket_addrs\b", "sockets"),
    (r"\bstd::thread\b|\bthread::spawn\b", "threads"),
    (r"\bInstant::now\b|\bSystemTime\b", "clocks"),
    (r"\bstd::fs\b|\bFile::open\b", "files"),
    (r"\bstd::process\b", "processes"),
    (r"\blibc::", "system calls"),
]


def dependencies(crate: Path) -> set:
    """The freight crates in a Cargo.toml's [dependencies] (not dev- or build-)."""
    deps, section = set(), None
    for line in (crate / "Cargo.toml").read_text().splitlines():
        header = re.match(r"\s*\[([^\]]+)\]", line)
        if header:
            section = header.group(1).strip()
            continue
        name = re.match(r"\s*(freight-[a-z]+)\s*[.=]", line)
        if section == "dependencies" and name:
            deps.add(name.group(1))
    return deps


def code_of(path: Path) -> str:
    """A source file without its comments and its `#[cfg(test)] mod tests` block."""
    text = path.read_text()
    text = re.split(r"#\[cfg\(test\)\]\s*mod tests\b", text)[0]
    return re.sub(r"//[^\n]*", "", text)


def test_only_modules(src: Path) -> set:
    """Files of modules declared `#[cfg(test)] mod name;`."""
    out = set()
    for path in src.rglob("*.rs"):
        for name in re.findall(r"#\[cfg\(test\)\]\s*(?:pub(?:\([a-z]+\))?\s+)?mod\s+([a-z_0-9]+)\s*;", path.read_text()):
            base = path.parent if path.name in ("lib.rs", "mod.rs") else path.with_suffix("")
            out |= {base / f"{name}.rs", base / name / "mod.rs"}
    return out


def module_path(src: Path, path: Path) -> tuple:
    parts = list(path.relative_to(src).with_suffix("").parts)
    if parts[-1] in ("lib", "mod", "main"):
        parts = parts[:-1]
    return tuple(parts)


def cycles(src: Path) -> list:
    """Import cycles among the modules of a crate, at every depth of its module tree."""
    skip = test_only_modules(src)
    files = [p for p in src.rglob("*.rs") if p not in skip]
    refs = []  # (from module, to module)
    for path in files:
        me = module_path(src, path)
        for target in re.findall(r"\bcrate::((?:[a-z_][a-z0-9_]*)(?:::[a-z_][a-z0-9_]*)*)", code_of(path)):
            refs.append((me, tuple(target.split("::"))))
    found = []
    depth = max((len(m) for m, _ in refs), default=0)
    for d in range(1, depth + 1):
        graph: dict = {}
        for me, target in refs:
            a, b = me[:d], target[:d]
            # A module and those nested in it may refer to each other.
            if a == b or a[: len(b)] == b or b[: len(a)] == a:
                continue
            graph.setdefault(a, set()).add(b)
        for comp in strongly_connected(graph):
            name = sorted("::".join(m) for m in comp)
            if name not in found:
                found.append(name)
    return found


def strongly_connected(graph: dict) -> list:
    """Tarjan's algorithm: the components of more than one node."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]
    nodes = set(graph) | {t for ts in graph.values() for t in ts}

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(comp)

    sys.setrecursionlimit(10000)
    for v in sorted(nodes):
        if v not in index:
            visit(v)
    return out


def main() -> int:
    problems = []
    crates = sorted(p for p in CRATES.iterdir() if (p / "Cargo.toml").exists())
    for crate in crates:
        name = crate.name
        if name not in ALLOWED:
            problems.append(f"{name}: a crate this check does not place in a layer (add it to ALLOWED)")
            continue
        for dep in sorted(dependencies(crate) - ALLOWED[name]):
            problems.append(f"{name} depends on {dep}, a crate above it or beside it")
        for cycle in cycles(crate / "src"):
            problems.append(f"{name}: an import cycle among the modules {', '.join(cycle)}")
    proto = CRATES / "freight-proto" / "src"
    skip = test_only_modules(proto)
    for path in sorted(proto.rglob("*.rs")):
        if path in skip:
            continue
        code = code_of(path)
        for pattern, what in NO_IO:
            for m in re.finditer(pattern, code):
                line = code[: m.start()].count("\n") + 1
                problems.append(f"{path.relative_to(ROOT)}:{line}: freight-proto uses {what} ({m.group(0)})")
    if problems:
        print("\n".join(problems))
        return 1
    print(f"layers: {len(crates)} crates in their layers, no import cycle, freight-proto without I/O")
    return 0


if __name__ == "__main__":
    sys.exit(main())
