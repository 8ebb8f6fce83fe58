"""The newcomer's install (CONTRACT.md 23): a half-built .venv is made again rather than a dead end, a machine
without python3-venv is told the one apt command, and the demo's keys come with their roles in a private file."""

import os
import re
import shutil
import stat
import subprocess
import sys

from conftest import ROOT


def make(directory, *args):
    return subprocess.run(['make', *args], cwd=directory, capture_output=True, text=True, timeout=300)


def test_a_half_built_venv_is_made_again(tmp_path):
    shutil.copy(ROOT / 'Makefile', tmp_path)
    (tmp_path / 'requirements.txt').write_text('# nothing: only the venv is under test\n')
    broken = tmp_path / '.venv' / 'bin'
    broken.mkdir(parents=True)
    (broken / 'python').symlink_to('/bin/false')       # what python3 -m venv leaves without python3-venv: no pip
    done = make(tmp_path, '.venv/stamp')
    assert done.returncode == 0, done.stdout + done.stderr
    pip = subprocess.run([str(tmp_path / '.venv' / 'bin' / 'python'), '-m', 'pip', '--version'], capture_output=True,
                         text=True, timeout=60)
    assert pip.returncode == 0 and pip.stdout.startswith('pip '), pip.stderr
    assert (tmp_path / '.venv' / 'stamp').exists()


def test_without_python3_venv_make_names_the_package_and_leaves_no_half_built_venv(tmp_path):
    shutil.copy(ROOT / 'Makefile', tmp_path)
    (tmp_path / 'requirements.txt').write_text('')
    done = make(tmp_path, '.venv/stamp', 'PYTHON=false')       # a python whose `-m venv` fails
    assert done.returncode != 0
    assert "install Debian's python3-venv (sudo apt-get install python3-venv)" in done.stdout + done.stderr
    assert not (tmp_path / '.venv').exists()


def test_the_seed_names_each_demo_key_with_its_role_in_a_file_only_its_owner_reads(tmp_path):
    keys_file = tmp_path / 'demo-keys.txt'
    done = subprocess.run([sys.executable, str(ROOT / 'marketplace.py'), 'seed', '--db', str(tmp_path / 'demo.db'),
                           '--keys-file', str(keys_file)], capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**os.environ, 'MARKETPLACE_ADMIN_KEY': ''})
    assert done.returncode == 0, done.stderr
    assert stat.S_IMODE(keys_file.stat().st_mode) == 0o600
    lines = keys_file.read_text().splitlines()
    assert lines[0].startswith('# The demo accounts of')
    rows = {line.split()[0]: line for line in lines[1:]}
    assert len(rows) == 8
    assert re.fullmatch(r'demo-admin +admin +may act on any job, agent or dispute +mk_\S{40,}', rows['demo-admin'])
    assert re.fullmatch(r'scribe-labs +member +owns agent Scribe +mk_\S{40,}', rows['scribe-labs'])
    assert re.fullmatch(r'acme-research +member +posts jobs +mk_\S{40,}', rows['acme-research'])
    assert all(row in done.stdout for row in rows.values())       # printed as written
