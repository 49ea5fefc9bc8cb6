#!/usr/bin/env python3
"""Import cycles between the files of each crate (crates/*/src).

Every file is one module (`lib.rs` the root, `a.rs` or `a/mod.rs` the module `a`, `a/b.rs` the
module `a::b`). A file depends on another when it names a path into it: `use crate::…`,
`use super::…`, `use self::…` and the same paths written inline in code. A path is followed
through the modules it names and, where it ends at a name that the module re-exports
(`pub use x::Name`), on to where that name comes from. References from a module to its own
descendants (declaring and re-exporting its children) are not counted: a parent owns its
children, and test code (`#[cfg(test)]` modules, inline or in their own files) is left out.
Prints each cycle (a strongly connected set of two or more files) and exits 1 when
there is one.

Usage: scripts/import_cycles.py [REPO]   (default: the repository this script is in)
"""
import os
import re
import sys

ROOT = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), ".."))


def strip_comments(src):
    src = re.sub(r"/\*.*?\*/", "", src, flags=re.S)
    src = re.sub(r"//[^\n]*", "", src)
    return re.sub(r'"(\\.|[^"\\])*"', '""', src)


def strip_tests(src):
    """`src` without its inline `#[cfg(test)] mod name { … }` blocks."""
    while True:
        m = re.search(r"#\[cfg\(test\)\]\s*(?:pub(?:\([^)]*\))?\s+)?mod\s+\w+\s*\{", src)
        if not m:
            return src
        depth, i = 1, m.end()
        while depth and i < len(src):
            depth += {"{": 1, "}": -1}.get(src[i], 0)
            i += 1
        src = src[: m.start()] + src[i:]


def test_children(src):
    """The child modules that `src` declares under `#[cfg(test)]` in files of their own."""
    return re.findall(r"#\[cfg\(test\)\]\s*(?:pub(?:\([^)]*\))?\s+)?mod\s+(\w+)\s*;", src)


def modules_of(src_dir):
    mods = {}
    for dirpath, _, files in os.walk(src_dir):
        for f in files:
            if not f.endswith(".rs"):
                continue
            rel = os.path.relpath(os.path.join(dirpath, f), src_dir)
            parts = rel[:-3].split(os.sep)
            if parts[-1] in ("lib", "main", "mod"):
                parts = parts[:-1]
            mods[tuple(parts)] = os.path.join(dirpath, f)
    return mods


def use_trees(src):
    """Yields every path of every `use` item, braces expanded."""
    for m in re.finditer(r"\buse\s+([^;]+);", src):
        yield from expand(m.group(1).replace("\n", " ").replace(" ", ""))


def expand(tree):
    depth, start = 0, None
    for i, c in enumerate(tree):
        if c == "{":
            if depth == 0:
                start = i
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                prefix = tree[:start]
                inner = tree[start + 1 : i]
                for item in split_top(inner):
                    for p in expand(item):
                        yield prefix + p if p != "self" else prefix.rstrip(":")
                return
    yield tree


def split_top(s):
    out, depth, cur = [], 0, ""
    for c in s:
        if c == "," and depth == 0:
            out.append(cur)
            cur = ""
            continue
        depth += c == "{"
        depth -= c == "}"
        cur += c
    if cur:
        out.append(cur)
    return [x for x in out if x]


def main():
    found = False
    for crate in sorted(os.listdir(os.path.join(ROOT, "crates"))):
        src_dir = os.path.join(ROOT, "crates", crate, "src")
        if not os.path.isdir(src_dir):
            continue
        mods = modules_of(src_dir)
        srcs = {m: strip_comments(open(p).read()) for m, p in mods.items()}
        tests = {m + (c,) for m, s in srcs.items() for c in test_children(s)}
        mods = {m: p for m, p in mods.items() if not any(m[: len(t)] == t for t in tests)}
        srcs = {m: strip_tests(s) for m, s in srcs.items() if m in mods}
        # name -> path of each `pub use` (a module's re-exports).
        reexports = {}
        for m, s in srcs.items():
            for mm in re.finditer(r"\bpub(?:\([^)]*\))?\s+use\s+([^;]+);", s):
                for p in expand(mm.group(1).replace("\n", " ").replace(" ", "")):
                    p = re.sub(r"\s+as\s+\w+$", "", p)
                    name = p.split("::")[-1]
                    reexports.setdefault(m, {})[name] = p

        def resolve(cur, path, hops=0):
            segs = [s for s in re.sub(r"as\w+$", "", path).split("::") if s]
            if not segs:
                return None
            if segs[0] == "crate":
                at, segs = (), segs[1:]
            elif segs[0] in ("super", "self"):
                at = cur
                while segs and segs[0] in ("super", "self"):
                    if segs[0] == "super":
                        at = at[:-1]
                    segs = segs[1:]
            elif segs[0] in [m[-1] for m in mods if m[:-1] == cur and m]:
                at = cur  # a child module named directly (`use child::X` inside the parent)
            else:
                return None
            while segs and at + (segs[0],) in mods:
                at, segs = at + (segs[0],), segs[1:]
            if segs and hops < 8 and segs[0] in reexports.get(at, {}):
                target = resolve(at, reexports[at][segs[0]], hops + 1)
                if target is not None:
                    return target
            return at

        edges = {m: set() for m in mods}
        for m, s in srcs.items():
            paths = set(use_trees(s))
            paths |= set(re.findall(r"\b(?:crate|super|self)(?:::\w+)+", s))
            for p in paths:
                t = resolve(m, p)
                if t is None or t == m or t[: len(m)] == m:
                    continue
                edges[m].add(t)
        for scc in sccs(edges):
            if len(scc) > 1:
                found = True
                names = sorted(os.path.relpath(mods[m], ROOT) for m in scc)
                print(f"{crate}: cycle of {len(names)} files: " + ", ".join(names))
    if not found:
        print("no import cycles")
    return 1 if found else 0


def sccs(edges):
    index, low, stack, on, out, n = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = n[0]
        n[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges[v]:
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
            out.append(comp)

    sys.setrecursionlimit(10000)
    for v in edges:
        if v not in index:
            visit(v)
    return out


if __name__ == "__main__":
    sys.exit(main())
