"""The README's promises: a guide of about 150 lines that opens with the two commands, a curl walkthrough that runs
as written, reference in docs/ by topic with a settings table that is true, and no link, anchor or file named that
the repository does not hold (CONTRACT.md 23)."""

import re
import subprocess
from urllib.parse import unquote

import marketplace as mp
from conftest import ROOT

README = (ROOT / 'README.md').read_text()
DOCS = sorted((ROOT / 'docs').glob('*.md'))
PAGES = [ROOT / 'README.md', *DOCS]
# What the docs name without holding it: files an example or `make run` writes, an MCP host's own settings file.
# (artifacts/ is what the tests and `make bench` write.)
MADE_BY_EXAMPLES = {'sign_funding.py', 'job.json', 'demo-keys.txt', 'marketplace.db', 'chain-demo.db',
                    'chain-demo-keys.txt', 'claude_desktop_config.json'}


def walkthrough():
    block = README.split('<!-- walkthrough:start -->')[1].split('<!-- walkthrough:end -->')[0]
    return block.strip().removeprefix('```sh').removesuffix('```')


def test_walkthrough_runs_as_written_and_prints_what_it_shows(live_server, tmp_path):
    script = walkthrough().replace('BASE=http://127.0.0.1:8080', f'BASE={live_server.url}', 1)
    assert f'BASE={live_server.url}' in script
    expected = re.findall(r'^# → (.*)$', script, re.MULTILINE)
    run = subprocess.run(['bash', '-euo', 'pipefail', '-c', script], capture_output=True, text=True,
                         timeout=60, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == expected
    assert expected == ['0.00', 'locked', 'claimed', 'delivered', 'released', '25.00', 'completed',
                        'rejected', 'refund', '0.75', 'claim_not_delivered']


def shown_default(setting):
    if setting.default in ('', ()):
        return '(empty)'
    if isinstance(setting.default, bool):
        return f'`{str(setting.default).lower()}`'
    return f'`{setting.default}`'


def test_settings_table_matches_the_settings():
    section = (ROOT / 'docs' / 'operations.md').read_text().split('## Settings')[1].split('\n## ')[0]
    rows = [line for line in section.splitlines() if line.startswith('| `')]
    documented = [[cell.strip() for cell in row.strip('|').split('|')] for row in rows]
    expected = []
    for setting in mp.SETTINGS:
        flag = setting.flag.replace('--', '--[no-]') if setting.type is mp.parse_bool else setting.flag
        expected.append([f'`{flag}`', f'`{setting.env}`', shown_default(setting), setting.help])
    assert documented == expected


def test_readme_opens_with_the_two_commands():
    first_block = README.split('```sh')[1].split('```')[0]
    assert [line.split('#')[0].strip() for line in first_block.strip().splitlines()] == ['make run', 'make test']


def test_readme_is_a_guide_and_docs_hold_the_reference():
    assert len(README.splitlines()) <= 160
    assert {page.name for page in DOCS} >= {'api.md', 'payments-on-chain.md', 'stripe.md', 'x402.md',
                                             'operations.md', 'security.md', 'limits.md', 'development.md'}
    contents = README.split('## Contents')[1].split('\n## ')[0]
    assert sorted(set(re.findall(r'\]\((docs/[^)#]+)\)', contents))) == [f'docs/{page.name}' for page in DOCS]


def outside_code(text):
    """The text with its fenced code blocks and inline code left out (links there are examples, not links)."""
    return re.sub(r'`[^`\n]*`', '', re.sub(r'^```.*?^```', '', text, flags=re.S | re.M))


def anchors(path):
    """GitHub's anchors for a page's headings: lower case, punctuation dropped, spaces as hyphens."""
    headings = re.findall(r'^#{1,6} (.+)$', re.sub(r'^```.*?^```', '', path.read_text(), flags=re.S | re.M), re.M)
    return {re.sub(r'[^\w\- ]', '', heading.replace('`', '').lower()).replace(' ', '-') for heading in headings}


def test_every_relative_link_and_anchor_leads_somewhere():
    checked = 0
    for page in PAGES:
        for target in re.findall(r'\]\(([^)\s]+)\)', outside_code(page.read_text())):
            if re.match(r'[a-z]+:', target):
                continue                # http(s) and mailto links leave the repository
            path, _, anchor = unquote(target).partition('#')
            where = (page.parent / path).resolve() if path else page
            assert where.is_relative_to(ROOT) and where.exists(), f'{page.name}: {target} names no file here'
            if anchor:
                assert anchor in anchors(where), f'{page.name}: {target}: {where.name} has no heading #{anchor}'
            checked += 1
    assert checked >= 60


def test_every_file_the_docs_name_is_in_the_repository():
    """A path in `code` is a file or folder here; a bare file name is one somewhere here; `file.py::test_x` names a
    test that file defines."""
    held = {path.name for path in ROOT.rglob('*') if not {'.git', '.venv', 'node_modules'} & set(path.parts)}
    named, missing = set(), []
    for page in PAGES:
        for code in re.findall(r'`([^`\n]+)`', page.read_text()):
            for word in code.split():
                word, _, test = word.strip('([",;:\'').rstrip('.)]').partition('::')
                if word.startswith(('/', '.venv/', 'http', 'application/', 'text/', 'artifacts/')) or \
                        not re.fullmatch(r'[\w.-]*[\w-]\.(?:py|md|sql|json|txt|tpl|sol|js|css|svg|service|example|yml)'
                                         r'|\.?(?:[\w.-]+/)+[\w.-]*', word):
                    continue
                named.add(word)
                if word in MADE_BY_EXAMPLES:
                    continue
                if not ((ROOT / word).exists() if '/' in word else word in held):
                    missing.append(f'{page.name}: {word}')
                elif test and f'def {test}(' not in next(ROOT.rglob(word)).read_text():
                    missing.append(f'{page.name}: {word}::{test}')
    assert missing == []
    assert {'requirements.txt', 'requirements-dev.txt', 'deploy/marketplace.service', 'test_theft.py'} <= named
