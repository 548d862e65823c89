#!/usr/bin/env python3
"""The file circles inside each crate of the workspace (`cargo xtask ci` runs it).

A file uses another when it names an item there: a `use` (not a `pub use`, which
is the module's table of contents) or a `crate::`/`super::`/`self::`/child path in
code; a name re-exported by a `pub use` counts as a use of the file that defines
it. A circle whose every use runs between a module and its own descendants (the
`mod.rs` that declares the trait, the children that implement it) is reported
with --all only; any other circle fails the check, because then some file uses
one that is not below it.

  python3 xtask/circles.py [ROOT] [--all]   exit 1 on a circle between siblings
  python3 xtask/circles.py --self-test      seeds a circle and checks it is found
"""
import os, re, sys, glob

def strip(text):
    text = re.sub(r'//[^\n]*', '', text)
    text = re.sub(r'/\*.*?\*/', '', text, flags=re.S)
    # re.S: a backslash before a newline (a string's line continuation) is an
    # escape too, or the match would start at the string's closing quote.
    return re.sub(r'"(\\.|[^"\\])*"', '""', text, flags=re.S)

def inline_modules(text):
    """`text` with `super::` inside each inline `mod NAME { ... }` (a test
    module, say) written `self::`: there `super` is the file's own module,
    not its parent."""
    out, i = [], 0
    for m in re.finditer(r'\bmod\s+\w+\s*\{', text):
        if m.start() < i:
            continue
        depth, j = 1, m.end()
        while j < len(text) and depth:
            depth += (text[j] == '{') - (text[j] == '}')
            j += 1
        out.append(text[i:m.end()])
        out.append(re.sub(r'\bsuper::', 'self::', text[m.end():j]))
        i = j
    out.append(text[i:])
    return ''.join(out)

def split_top(s):
    parts, depth, cur = [], 0, ''
    for c in s:
        depth += (c == '{') - (c == '}')
        if c == ',' and depth == 0:
            parts.append(cur); cur = ''
        else:
            cur += c
    return parts + ([cur] if cur else [])

def expand(tree, prefix=()):
    tree = re.sub(r'\s+', ' ', tree).strip()
    m = re.match(r'^(.*?)::\{(.*)\}$', tree.replace(' ', ''))
    t = tree.replace(' ', '')
    if t.startswith('{') and t.endswith('}'):
        return [p for part in split_top(t[1:-1]) for p in expand(part, prefix)]
    if m:
        head = tuple(x for x in m.group(1).split('::') if x)
        return [p for part in split_top(m.group(2)) for p in expand(part, prefix + head)]
    t = re.sub(r'as\w+$', '', t) if 'as' in t and ' as ' in tree else t
    t = tree.split(' as ')[0].replace(' ', '')
    return [prefix + tuple(x for x in t.split('::') if x)]

def scan(src):
    files = {}
    for p in glob.glob(f'{src}/**/*.rs', recursive=True):
        rel = os.path.relpath(p, src)[:-3].split('/')
        if rel[-1] == 'mod':
            rel = rel[:-1]
        if rel in (['lib'], ['main']):
            rel = []
        files[tuple(rel)] = p
    graph = {m: set() for m in files}
    # Where each item name is defined (to see through `pub use` re-exports).
    defined = {}
    for mod, p in files.items():
        for m in re.finditer(r'^\s*(?:pub(?:\([^)]*\))?\s+)?(?:unsafe\s+)?(?:struct|enum|fn|trait|type|const|static|macro_rules!)\s+(\w+)', strip(open(p).read()), re.M):
            defined.setdefault(m.group(1), set()).add(mod)
    reexports = {mod: {seg for m in re.finditer(r'\bpub(?:\([^)]*\))?\s+use\s+([^;]+);', strip(open(p).read())) for segs in expand(m.group(1)) for seg in segs[-1:]} for mod, p in files.items()}
    for mod, p in files.items():
        text = inline_modules(strip(open(p).read()))
        children = {m[-1] for m in files if len(m) == len(mod) + 1 and m[:-1] == mod}
        # A `pub use` is the module's table of contents (a re-export), not a use.
        refs = [s for m in re.finditer(r'(?<!pub )(?<!\) )\buse\s+([^;]+);', text) for s in expand(m.group(1))]
        text = re.sub(r'\bpub(?:\([^)]*\))?\s+use\s+[^;]+;', '', text)
        refs += [tuple(m.group(1).split('::')) for m in re.finditer(r'\b((?:crate|super|self)(?:::\w+)+)', text)]
        refs += [tuple(m.group(1).split('::')) for m in re.finditer(r'\b(\w+(?:::\w+)+)', text) if m.group(1).split('::')[0] in children]
        for segs in refs:
            if not segs:
                continue
            if segs[0] == 'crate':
                absolute = list(segs[1:])
            elif segs[0] in ('super', 'self'):
                base, s = list(mod), list(segs)
                while s and s[0] in ('super', 'self'):
                    if s[0] == 'super':
                        base = base[:-1]
                    s = s[1:]
                absolute = base + s
            elif segs[0] in children:
                absolute = list(mod) + list(segs)
            else:
                continue
            for k in range(len(absolute), -1, -1):
                if tuple(absolute[:k]) in files:
                    target = tuple(absolute[:k])
                    rest = absolute[k:]
                    homes = defined.get(rest[0], set()) if rest else set()
                    if len(homes) == 1 and target not in homes and rest[0] in reexports[target]:
                        target = next(iter(homes))
                    if target != mod:
                        graph[mod].add(target)
                    break
    return files, graph

def sccs(graph):
    index, low, stack, on, out, n = {}, {}, [], set(), [], [0]
    def visit(v):
        index[v] = low[v] = n[0]; n[0] += 1; stack.append(v); on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w); low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop(); on.discard(w); comp.append(w)
                if w == v:
                    break
            out.append(comp)
    sys.setrecursionlimit(10000)
    for v in graph:
        if v not in index:
            visit(v)
    return [c for c in out if len(c) > 1]

def check(root, show_all=False):
    """Prints the circles of the crates under `root`; returns how many fail."""
    srcs = sorted({os.path.dirname(p) for p in glob.glob(f'{root}/crates/*/src/lib.rs')
                   + glob.glob(f'{root}/crates/*/src/main.rs') + glob.glob(f'{root}/xtask/src/main.rs')})
    failing = 0
    for src in srcs:
        files, graph = scan(src)
        for comp in sccs(graph):
            names = ' <-> '.join(sorted(os.path.relpath(files[m], root) for m in comp))
            family = all(len(a) != len(b) and (a[:len(b)] == b or b[:len(a)] == a)
                         for a in comp for b in graph[a] if b in comp)
            if not family:
                failing += 1
                print(f'circle: {names}')
            elif show_all:
                print(f'(module and descendants) {names}')
    return failing


def self_test():
    """Each step rewrites some files of a small crate and says how many
    circles the check must then find."""
    import tempfile
    steps = [
        ({'lib.rs': 'mod a;\nmod b;\nmod inner;\npub use a::A;\n', 'a.rs': 'pub struct A;\n',
          'b.rs': 'use crate::A;\npub struct B;\n', 'inner/mod.rs': 'mod x;\nmod y;\npub fn f() { x::g() }\n',
          'inner/x.rs': 'pub fn g() { super::f() }\n', 'inner/y.rs': 'pub struct Y;\n'},
         0, 'a clean tree (re-export, module and child) was reported'),
        ({'a.rs': 'use crate::b::B;\npub struct A;\n'},
         1, 'the seeded a <-> b circle (b reaches a through a re-export) was missed'),
        ({'a.rs': 'pub struct A;\n', 'inner/y.rs': 'pub struct Y;\npub fn h() { super::x::g() }\n',
          'inner/x.rs': 'use super::y::Y;\npub fn g() {}\n'},
         1, 'the seeded x <-> y circle between siblings was missed'),
        # A string continued over lines (a backslash, then a newline) before the use.
        ({'inner/x.rs': 'const H: &str = "\\\nhelp\n";\npub fn g() { crate::inner::y::h(); let _ = "x"; }\n',
          'inner/y.rs': 'pub fn h() { super::x::g() }\n'},
         1, 'a circle behind a string with a line continuation was missed'),
        # A child's test module importing its own module's items is no use of the parent.
        ({'inner/x.rs': 'pub fn g() {}\n#[cfg(test)]\nmod tests {\n    use super::*;\n}\n',
          'inner/y.rs': 'pub struct Y;\npub fn h() { super::x::g() }\n', 'inner/mod.rs': 'mod x;\nmod y;\npub fn f() { y::h() }\n'},
         0, "a test module's use of super::* was read as a use of the parent"),
    ]
    with tempfile.TemporaryDirectory() as d:
        src = f'{d}/crates/demo/src'
        os.makedirs(f'{src}/inner')
        for files, circles, why in steps:
            for name, text in files.items():
                open(f'{src}/{name}', 'w').write(text)
            assert check(d) == circles, why
    print('circles self-test: ok')


if __name__ == '__main__':
    args = [a for a in sys.argv[1:] if not a.startswith('--')]
    if '--self-test' in sys.argv:
        self_test()
        sys.exit(0)
    root = args[0] if args else os.path.join(os.path.dirname(os.path.abspath(__file__)), '..')
    n = check(root, '--all' in sys.argv)
    print(f'{n} circle(s) between files' + ('' if n == 0 else ': break each so that every file uses only files below it'))
    sys.exit(1 if n else 0)
