"""The README's promises: the curl walkthrough runs as written, and the settings table is true."""

import re
import subprocess

import marketplace as mp
from conftest import ROOT

README = (ROOT / 'README.md').read_text()


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
    section = README.split('## Settings')[1].split('\n## ')[0]
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
