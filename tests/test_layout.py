"""The house (docs/development.md "Layout: the house"): one file of rules, a room for each face, imports that run one way.

The import graph is read from the source (every import, at any depth, but the `if __name__ == '__main__'` block
that hands a script run over to wiring.py), so an import hidden inside a function counts as any other."""

import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FACES = {'a2a_binding', 'command_line', 'remote_mcp', 'oauth', 'pages', 'openapi_spec', 'http_server', 'pay_per_call',
         'webhook_delivery', 'discovery', 'mcp_server'}
BELOW = {'database', 'errors', 'host_guard', 'migrations', 'metrics', 'read_cache', 'replication', 'stripe_rail', 'verifier'}
OURS = FACES | BELOW | {'marketplace', 'wiring'}


def is_main_block(node):
    test = getattr(node, 'test', None)
    return isinstance(node, ast.If) and isinstance(test, ast.Compare) and \
        getattr(test.left, 'id', None) == '__name__' and getattr(test.comparators[0], 'value', None) == '__main__'


def imports_of(path):
    """{our module it imports: [(line, inside a function?)]}, the script-only __main__ block left out."""
    found = {}

    def visit(node, in_function):
        for child in ast.iter_child_nodes(node):
            if is_main_block(child):
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                names = [alias.name for alias in child.names] if isinstance(child, ast.Import) else [child.module or '']
                for name in names:
                    top = name.split('.')[0]
                    if top in OURS:
                        found.setdefault(top, []).append((child.lineno, in_function))
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))
    visit(ast.parse(path.read_text()), False)
    return found


def graph():
    modules = {path.stem: path for path in ROOT.glob('*.py')}
    modules['verifier'] = ROOT / 'verifier' / '__init__.py'
    edges = {name: imports_of(path) for name, path in modules.items()}
    for path in (ROOT / 'verifier').glob('*.py'):      # the package as one node
        for target, places in imports_of(path).items():
            if target != 'verifier':
                edges['verifier'].setdefault(target, []).extend(places)
    return edges


def reachable(edges, start):
    seen, todo = set(), [start]
    while todo:
        for target in edges.get(todo.pop(), {}):
            if target not in seen:
                seen.add(target)
                todo.append(target)
    return seen


def test_every_module_at_the_top_is_known_and_each_face_has_a_docstring_that_says_what_it_owns():
    assert {path.stem for path in ROOT.glob('*.py')} == OURS - {'verifier'}
    for face in FACES | {'wiring', 'migrations'}:
        doc = ast.get_docstring(ast.parse((ROOT / f'{face}.py').read_text()))
        assert doc and len(doc.split()) >= 25, face


def test_the_rules_import_no_face_and_nothing_imports_the_top():
    edges = graph()
    assert set(edges['marketplace']) <= BELOW, edges['marketplace']
    assert reachable(edges, 'marketplace') & (FACES | {'wiring'}) == set()
    for name, targets in edges.items():
        assert 'wiring' not in targets, name
        if name in BELOW:
            assert set(targets) <= BELOW, (name, targets)   # what is below imports nothing above it
    assert set(edges['wiring']) == FACES | {'marketplace'}
    assert set(edges['mcp_server']) == set()        # an HTTP client of the API
    assert edges['wiring']['mcp_server'] == [(edges['wiring']['mcp_server'][0][0], True)]  # only for `mcp`


def test_there_is_no_cycle_and_no_import_inside_a_function_hides_one():
    edges = graph()
    for name in edges:
        assert name not in reachable(edges, name), f'{name} imports itself through {reachable(edges, name)}'
    for name, targets in edges.items():
        for target, places in targets.items():
            if any(inside for _, inside in places):
                assert name not in reachable(edges, target), (name, target)
                assert target not in FACES | {'marketplace', 'wiring'} or name == 'wiring', (name, target, places)


def test_importing_the_rules_alone_loads_no_face():
    code = ('import sys, marketplace; print(sorted(m for m in sys.modules if m in %r))' % sorted(OURS))
    done = subprocess.run([sys.executable, '-c', code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(['database', 'errors', 'host_guard', 'marketplace', 'metrics', 'migrations',
                                       'read_cache', 'replication', 'verifier'])


def test_marketplace_py_stays_within_its_size_and_no_section_is_over_800_lines():
    lines = (ROOT / 'marketplace.py').read_text().split('\n')
    assert len(lines) <= 6500
    banners = [n for n, line in enumerate(lines) if re.fullmatch(r'# \S.* #{3,}', line)] + [len(lines)]
    sizes = {lines[start]: end - start for start, end in zip(banners, banners[1:])}
    assert len(sizes) >= 23       # errors and the database moved to errors.py and database.py (issue 43)
    assert max(sizes.values()) <= 800, max(sizes.items(), key=lambda item: item[1])
