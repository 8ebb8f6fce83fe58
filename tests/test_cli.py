"""The command line: keys, seed, backup, check-ledger, migrations and `make help`."""

import hashlib
import json
import os
import re
import subprocess
import sys
from datetime import timedelta

import apsw
import pytest

from conftest import ROOT, Client, job_body

import command_line
import marketplace as mp
import migrations
import wiring

FIXTURES = json.loads((ROOT / 'fixtures' / 'demo.json').read_text())
KEY = re.compile(r'^mk_[A-Za-z0-9_-]{43}$')


def cli(db, *args, env=None):
    """Run `python marketplace.py ARGS --db DB` in the repository; the finished process."""
    clean = {name: value for name, value in os.environ.items() if not name.startswith('MARKETPLACE_')}
    clean.update(env or {})
    return subprocess.run([sys.executable, str(ROOT / 'marketplace.py'), *args, '--db', str(db)], cwd=ROOT,
                          env=clean, capture_output=True, text=True, timeout=30)


def open_app(db):
    return wiring.make_app(mp.Settings(db=str(db), rate_limits='off'))


@pytest.fixture
def db_path(tmp_path):
    return tmp_path / 'cli.db'


def create_key(db, name, *flags):
    """`keys create`: (account id, role, key)."""
    done = cli(db, 'keys', 'create', '--name', name, *flags)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 2, done.stdout
    match = re.fullmatch(r'account ([0-9a-f-]{36}) \((admin|member)\) (.+)', lines[0])
    assert match, lines[0]
    assert match.group(3) == name
    assert KEY.match(lines[1]), lines[1]
    return match.group(1), match.group(2), lines[1]


def snapshot(db_path):
    """Every row of every table, to tell whether a command changed the database."""
    conn = apsw.Connection(str(db_path))
    try:
        tables = [row[0] for row in conn.execute(
            "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%' ORDER BY name")]
        return {table: sorted(map(repr, conn.execute(f'SELECT * FROM "{table}"'))) for table in tables}
    finally:
        conn.close()


@pytest.fixture(scope='module')
def seeded_template(tmp_path_factory):
    """One seeded database (and the seed output) that tests copy instead of seeding again."""
    path = tmp_path_factory.mktemp('seed') / 'demo.db'
    done = cli(path, 'seed')
    assert done.returncode == 0, done.stderr
    return path, done.stdout


@pytest.fixture
def seeded(seeded_template, tmp_path):
    """A private copy of the seeded database: (path, seed output)."""
    template, output = seeded_template
    copy = tmp_path / 'seeded.db'
    source = mp.Database(template)
    try:
        source.backup(copy)
    finally:
        source.close()
    return copy, output


# keys ------------------------------------------------------------------------

def test_keys_create_admin_makes_an_admin_key(db_path):
    admin_id, role, admin_key = create_key(db_path, 'ops', '--admin')
    assert role == 'admin'
    other_id, other_role, _ = create_key(db_path, 'customer')
    assert other_role == 'member'
    app = open_app(db_path)
    try:
        client = Client(app)
        # An admin may post on behalf of another account.
        answer = client.post('/api/jobs', job_body(requesterId=other_id), key=admin_key)
        assert answer.status == 201, answer
        assert answer.json['job']['requesterId'] == other_id
        assert mp.account_for_key(app.service.db, admin_key) == {'id': admin_id, 'name': 'ops', 'role': 'admin',
                                                                 'x402_exempt': 0}
        # Only the key's SHA-256 hash is stored.
        stored = app.service.db.row('SELECT key_hash, prefix FROM api_keys WHERE account_id = :id', {'id': admin_id})
        assert stored == {'key_hash': hashlib.sha256(admin_key.encode()).hexdigest(), 'prefix': admin_key[:10]}
        assert mp.ledger_problems(app.service.db) == []
    finally:
        app.service.close()


def test_keys_create_without_admin_makes_a_member_key(db_path):
    member_id, role, member_key = create_key(db_path, 'someone')
    assert role == 'member'
    other_id, _, _ = create_key(db_path, 'someone-else')
    app = open_app(db_path)
    try:
        client = Client(app)
        refused = client.post('/api/jobs', job_body(requesterId=other_id), key=member_key)
        assert refused.status == 403, refused
        assert refused.json['code'] == 'forbidden'
        own = client.post('/api/jobs', job_body(), key=member_key)
        assert own.status == 201, own
        assert own.json['job']['requesterId'] == member_id
    finally:
        app.service.close()


def test_keys_list_shows_prefixes_never_keys(db_path):
    _, _, admin_key = create_key(db_path, 'ops', '--admin')
    _, _, member_key = create_key(db_path, 'someone')
    done = cli(db_path, 'keys', 'list')
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 2, done.stdout
    for key, role, name, line in ((admin_key, 'admin', 'ops', lines[0]), (member_key, 'member', 'someone', lines[1])):
        key_id, prefix, listed_role, listed_name, state = line.split()
        assert re.fullmatch(r'[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}', key_id)
        assert prefix == key[:10]
        assert (listed_role, listed_name, state) == (role, name, 'live')
    for key in (admin_key, member_key):
        assert key not in done.stdout
        assert key[3:] not in done.stdout
        assert key[-20:] not in done.stdout


def test_keys_revoke_makes_the_key_unauthorized(db_path):
    _, _, key = create_key(db_path, 'ops', '--admin')
    key_id = cli(db_path, 'keys', 'list').stdout.split()[0]
    app = open_app(db_path)
    try:
        client = Client(app)
        assert client.post('/api/jobs', job_body(), key=key).status == 201
        done = cli(db_path, 'keys', 'revoke', key_id)
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == 'revoked'
        answer = client.post('/api/jobs', job_body(), key=key)
        assert answer.status == 401, answer
        assert answer.json['code'] == 'unauthorized'
        headers = {name.lower(): value for name, value in answer.headers.items()}   # names are case-insensitive
        assert headers['www-authenticate'] == 'Bearer'
    finally:
        app.service.close()
    listed = cli(db_path, 'keys', 'list').stdout
    assert listed.split()[0] == key_id
    assert ' revoked ' in listed
    # Revoking it again changes nothing and says so.
    again = cli(db_path, 'keys', 'revoke', key_id)
    assert again.returncode == 1
    assert again.stdout.strip() == 'no live key has that id'


def test_keys_revoke_an_unknown_id_exits_1(db_path):
    create_key(db_path, 'ops')
    before = snapshot(db_path)
    done = cli(db_path, 'keys', 'revoke', mp.new_id())
    assert done.returncode == 1
    assert done.stdout.strip() == 'no live key has that id'
    assert snapshot(db_path) == before


def test_keys_in_process(db_path, capsys):
    """The same commands through wiring.main, as a caller embedding the module would run them."""
    assert wiring.main(['keys', 'create', '--name', 'inproc', '--db', str(db_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert re.fullmatch(r'account [0-9a-f-]{36} \(member\) inproc', out[0])
    assert KEY.match(out[1])
    assert wiring.main(['keys', 'revoke', 'not-a-key-id', '--db', str(db_path)]) == 1
    assert capsys.readouterr().out.strip() == 'no live key has that id'


def test_keys_create_reads_the_name_as_the_api_does(db_path, capsys):
    """NFKC-normalised; a name with an invisible character is refused (exit 2) and nothing is made."""
    assert wiring.main(['keys', 'create', '--name', '\uff2f\uff50\uff53', '--db', str(db_path)]) == 0
    assert re.fullmatch(r'account [0-9a-f-]{36} \(member\) Ops', capsys.readouterr().out.splitlines()[0])
    with pytest.raises(SystemExit) as exited:
        wiring.main(['keys', 'create', '--name', 'pay\u200bpal', '--db', str(db_path)])
    assert exited.value.code == 2
    assert 'argument --name' in capsys.readouterr().err
    db = mp.Database(db_path)
    assert db.value('SELECT count(*) FROM accounts') == 1
    db.close()


def test_a_new_marketplace_admin_key_revokes_the_old_one_at_start(db_path):
    """MARKETPLACE_ADMIN_KEY=A, then B: A is revoked and its account made a member when B starts (here `sweep`,
    which starts the service as `serve` does); starting with A again is refused."""
    key_a, key_b = 'old-admin-key-' + 'a' * 32, 'new-admin-key-' + 'b' * 32
    for key in (key_a, key_b):
        done = cli(db_path, 'sweep', env={'MARKETPLACE_ADMIN_KEY': key})
        assert done.returncode == 0, done.stderr
    assert 'revoked 1 admin key(s) that MARKETPLACE_ADMIN_KEY named before' in done.stderr
    listed = [line.split() for line in cli(db_path, 'keys', 'list').stdout.splitlines()]
    assert [(prefix, role, name, state) for _, prefix, role, name, state, *_ in listed] == [
        (key_a[:4] + '…', 'member', 'admin', 'revoked'), (key_b[:4] + '…', 'admin', 'admin', 'live')]
    app = open_app(db_path)
    try:
        client = Client(app)
        assert client.post('/api/jobs/expire', key=key_a).status == 401
        assert client.post('/api/jobs/expire', key=key_b).status == 200
    finally:
        app.service.close()
    again = cli(db_path, 'sweep', env={'MARKETPLACE_ADMIN_KEY': key_a})
    assert again.returncode == 2
    assert 'the admin key was revoked: choose a new one' in again.stderr


# seed ------------------------------------------------------------------------

def demo_keys(output):
    """The seed's printed keys, {account name: key}: each line is '  name role what-it-does key'."""
    return {line.split()[0]: line.split()[-1] for line in output.splitlines()[2:] if line.startswith('  ')}


def test_seed_prints_eight_demo_keys(seeded):
    _, output = seeded
    lines = output.splitlines()
    assert lines[0].endswith(f': {len(FIXTURES["accounts"])} accounts, {len(FIXTURES["agents"])} agents, '
                             f'{len(FIXTURES["arbitrators"])} arbitrators, {len(FIXTURES["jobs"])} jobs.')
    keys = demo_keys(output)
    assert list(keys) == [account['name'] for account in FIXTURES['accounts']]
    assert len(keys) == 8
    assert all(KEY.match(key) for key in keys.values())
    rows = {line.split()[0]: line for line in lines[2:10]}         # name, role, what it does, key
    assert rows['demo-admin'].split()[1] == 'admin' and 'may act on any job, agent or dispute' in rows['demo-admin']
    assert rows['acme-research'].split()[1] == 'member' and 'posts jobs' in rows['acme-research']
    assert 'owns agent Coder-7' in ''.join(rows.values()) and 'arbitrates disputes' in ''.join(rows.values())


def test_seed_loads_the_fixtures(seeded):
    path, output = seeded
    keys = demo_keys(output)
    app = open_app(path)
    try:
        client = Client(app)
        jobs = client.get('/api/jobs?limit=200')
        assert jobs.status == 200
        assert jobs.json['total'] == len(FIXTURES['jobs']) == 10
        by_title = {job['title']: job for job in jobs.json['jobs']}
        assert set(by_title) == {job['title'] for job in FIXTURES['jobs']}
        assert sorted(job['status'] for job in jobs.json['jobs']) == sorted(
            ['open'] * 4 + ['claimed', 'delivered', 'completed', 'rejected', 'cancelled', 'disputed'])
        assert by_title['Blog post: SQLite in WAL mode']['status'] == 'claimed'
        assert by_title['Port a shell script to Python']['status'] == 'delivered'
        assert by_title['Translate the README into German']['status'] == 'completed'
        assert by_title['Translate the README into German']['escrowStatus'] == 'released'
        assert by_title['Add type hints to the billing module']['status'] == 'rejected'
        assert by_title['Add type hints to the billing module']['escrowStatus'] == 'refunded'
        assert by_title['Survey of vector databases']['status'] == 'cancelled'
        assert by_title['Logo for an open-source CLI']['paymentCurrency'] == 'USD'
        assert by_title['Clean a 50k-row customer CSV']['paymentAmount'] == '75.50'
        agents = client.get('/api/agents')
        assert sorted(agent['name'] for agent in agents.json['agents']) == ['Coder-7', 'Scribe']
        # Open arbitration in the seed: three active arbitrators (one trusted), the panel of the disputed job,
        # two of whose votes are cast.
        arbitrators = {a['name']: a for a in client.get('/api/arbitrators').json['arbitrators']}
        assert {name: (a['status'], a['trusted']) for name, a in arbitrators.items()} == \
            {'Ada': ('active', True), 'Grace': ('active', False), 'Linus': ('active', False)}
        [dispute] = client.get('/api/disputes').json['disputes']
        disputed = by_title['Move the cron jobs to systemd timers']
        assert (dispute['jobId'], dispute['status'], dispute['votesReceived'], dispute['needsAdmin']) == \
            (disputed['id'], 'open', 2, False)
        assert dispute['panel'] == sorted(a['id'] for a in arbitrators.values())
        assert (disputed['status'], disputed['escrowStatus']) == ('disputed', 'locked')
        assert keys['demo-admin'] and mp.account_for_key(app.service.db, keys['demo-admin'])['role'] == 'admin'
        assert mp.ledger_problems(app.service.db) == []
        # A demo key works.
        posted = client.post('/api/jobs', job_body(title='Posted with a demo key'), key=keys['acme-research'])
        assert posted.status == 201, posted
        acme = mp.account_for_key(app.service.db, keys['acme-research'])
        assert acme['name'] == 'acme-research' and acme['role'] == 'member'
        assert posted.json['job']['requesterId'] == acme['id']
        assert mp.ledger_problems(app.service.db) == []
    finally:
        app.service.close()


def test_seeding_twice_fails_without_changing_the_database(seeded):
    path, _ = seeded
    before = snapshot(path)
    done = cli(path, 'seed')
    assert done.returncode != 0
    assert 'already holds accounts' in done.stderr
    assert snapshot(path) == before


def test_seeding_twice_in_process_raises(seeded):
    path, _ = seeded
    before = snapshot(path)
    with pytest.raises(RuntimeError, match='already holds accounts'):
        command_line.seed(mp.Settings(db=str(path)), ROOT / 'fixtures' / 'demo.json', wiring.FACES, out=lambda line: None)
    assert snapshot(path) == before


# backup and check-ledger -----------------------------------------------------

def test_backup_while_the_database_is_in_use(seeded, tmp_path):
    path, output = seeded
    keys = demo_keys(output)
    app = open_app(path)      # another connection holds the database open, with fresh writes in the WAL
    try:
        client = Client(app)
        assert client.post('/api/jobs', job_body(title='written just before the backup'),
                           key=keys['northwind-data']).status == 201
        copy = tmp_path / 'copy.db'
        done = cli(path, 'backup', str(copy))
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == f'Backed up {path} to {copy}'
        # The original is still usable through the connection that stayed open.
        assert client.get('/api/jobs').json['total'] == len(FIXTURES['jobs']) + 1
    finally:
        app.service.close()
    backup = mp.Database(copy)
    try:
        assert backup.value('PRAGMA integrity_check') == 'ok'
        assert backup.value('PRAGMA user_version') == mp.SCHEMA_VERSION
        assert backup.value('SELECT count(*) FROM jobs') == len(FIXTURES['jobs']) + 1
        assert backup.value("SELECT count(*) FROM jobs WHERE title = 'written just before the backup'") == 1
        assert mp.ledger_problems(backup) == []
    finally:
        backup.close()
    # The copy serves like the original.
    app = open_app(copy)
    try:
        assert Client(app).get('/api/jobs').json['total'] == len(FIXTURES['jobs']) + 1
    finally:
        app.service.close()


def test_check_ledger_balances_then_finds_a_missing_entry(seeded):
    path, _ = seeded
    done = cli(path, 'check-ledger')
    assert done.returncode == 0, done.stderr
    assert done.stdout == 'The ledger balances.\n'

    db = mp.Database(path)
    try:
        last = db.row('SELECT payment_id, amount FROM ledger_entries WHERE rowid = (SELECT max(rowid) FROM ledger_entries)')
        assert db.execute('DELETE FROM ledger_entries WHERE rowid = (SELECT max(rowid) FROM ledger_entries)') == 1
    finally:
        db.close()

    broken = cli(path, 'check-ledger')
    assert broken.returncode == 1
    lines = broken.stdout.splitlines()
    assert 'The ledger balances.' not in broken.stdout
    assert f'payment {last["payment_id"]}: 1 entries, net {-last["amount"]}' in lines


def test_check_ledger_on_a_new_database(db_path):
    done = cli(db_path, 'check-ledger')
    assert done.returncode == 0, done.stderr
    assert done.stdout == 'The ledger balances.\n'


# Migrations ------------------------------------------------------------------

def test_a_newer_schema_is_refused(db_path):
    app = open_app(db_path)
    app.service.close()
    conn = apsw.Connection(str(db_path))
    conn.execute(f'PRAGMA user_version = {mp.SCHEMA_VERSION + 1}')
    conn.close()
    db = mp.Database(db_path)
    try:
        with pytest.raises(RuntimeError, match=rf'schema version {mp.SCHEMA_VERSION + 1}, newer than this program '
                                               rf'\({mp.SCHEMA_VERSION}\)'):
            db.migrate()
        assert db.value('PRAGMA user_version') == mp.SCHEMA_VERSION + 1     # left as it was
    finally:
        db.close()
    with pytest.raises(RuntimeError, match='newer than this program'):
        open_app(db_path)
    done = cli(db_path, 'check-ledger')
    assert done.returncode != 0
    assert 'newer than this program' in done.stderr


def test_a_restart_keeps_the_data(db_path):
    app = open_app(db_path)
    try:
        client = Client(app)
        answer = client.post('/api/accounts', {'name': 'keeper'})
        key = answer.json['apiKey']
        job = client.post('/api/jobs', job_body(deadline=mp.iso(mp.now() + timedelta(hours=5))), key=key).json['job']
    finally:
        app.service.close()
    for _ in range(2):
        app = open_app(db_path)
        try:
            client = Client(app)
            assert app.service.db.value('PRAGMA user_version') == mp.SCHEMA_VERSION
            shown = client.get(f'/api/jobs/{job["id"]}')
            assert shown.status == 200
            assert shown.json['job'] == job
            assert [p['type'] for p in shown.json['payments']] == ['escrow']
            assert client.post('/api/jobs', job_body(), key=key).status == 201    # the key still works
        finally:
            app.service.close()
    db = mp.Database(db_path)
    try:
        assert db.value('SELECT count(*) FROM jobs') == 3
        assert db.value('SELECT count(*) FROM accounts') == 1
        assert mp.ledger_problems(db) == []
    finally:
        db.close()


def test_the_database_is_opened_for_durability(db_path):
    app = open_app(db_path)
    try:
        db = app.service.db
        assert db.value('PRAGMA journal_mode') == 'wal'
        assert db.value('PRAGMA synchronous') == 2      # FULL
        assert db.value('PRAGMA foreign_keys') == 1
        assert db.value('PRAGMA user_version') == mp.SCHEMA_VERSION
    finally:
        app.service.close()


class OpenedFiles(apsw.VFS):
    """The default VFS, noting the kind (SQLITE_OPEN_* flags) of each file SQLite opens."""

    def __init__(self):
        self.kinds = []
        super().__init__('opened-files', base='', makedefault=True)

    def xOpen(self, name, flags):
        self.kinds.append(flags[0])
        return super().xOpen(name, flags)


def test_a_write_transaction_keeps_its_savepoint_journal_in_memory(db_path):
    opened = OpenedFiles()
    try:
        db = mp.Database(db_path)
        db.migrate()
        try:
            account, _ = mp.create_account(db, 'poster')
            fields = mp.read_job_body(job_body(description='x' * 4000), account)
            with db.transaction():          # one savepoint that changes far more than 64 KiB of pages
                for _ in range(40):
                    mp.create_job(db, mp.Settings(db=str(db_path)), dict(fields, id=None))
            assert db.value('SELECT count(*) FROM jobs') == 40
        finally:
            db.close()
    finally:
        opened.unregister()
    subjournal = apsw.mapping_open_flags['SQLITE_OPEN_SUBJOURNAL']
    assert opened.kinds and not [kind for kind in opened.kinds if kind & subjournal]


# make ------------------------------------------------------------------------

def test_make_help_lists_the_targets():
    done = subprocess.run(['make', '-C', str(ROOT), 'help'], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    targets = {match.group(1): match.group(2) for match in re.finditer(r'^\s+make (\S+)\s+(.+)$', done.stdout, re.M)}
    assert {'help', 'run', 'test', 'seed', 'clean'} <= set(targets)
    assert targets['test'] == 'run the whole test suite'
    assert targets['run'].startswith('serve the demo on http://127.0.0.1:8080')


def test_a_migration_brings_an_older_database_up_to_date(tmp_path):
    """An old database runs each pending migration's `before`, the schema, then its `after`, in order."""
    path = tmp_path / 'old.db'
    db = mp.Database(path)
    db.migrate()
    db.execute("INSERT INTO accounts (id, name, role, created_at) VALUES ('a1', 'old', 'member', '2026-01-01T00:00:00.000Z')")
    newer = mp.SCHEMA_SQL.replace(f'PRAGMA user_version = {mp.SCHEMA_VERSION};',
                                  'CREATE INDEX IF NOT EXISTS accounts_motto ON accounts(motto);\n'
                                  f'PRAGMA user_version = {mp.SCHEMA_VERSION + 1};')
    migrations = {mp.SCHEMA_VERSION + 1: {'before': 'ALTER TABLE accounts ADD COLUMN motto TEXT',
                                          'after': "UPDATE accounts SET motto = 'carried over'"}}
    db.migrate(newer, migrations)
    assert db.value('PRAGMA user_version') == mp.SCHEMA_VERSION + 1
    assert db.rows('SELECT name, motto FROM accounts') == [{'name': 'old', 'motto': 'carried over'}]
    assert db.value("SELECT count(*) FROM sqlite_master WHERE name = 'accounts_motto'") == 1
    db.migrate(newer, migrations)     # up to date: nothing runs again
    assert db.value('PRAGMA user_version') == mp.SCHEMA_VERSION + 1
    db.close()


SCHEMA_V3 = (ROOT / 'tests' / 'schema_v3.sql').read_text()     # schema.sql as version 3 left it


def test_a_version_1_database_gains_the_x402_tables_and_keeps_its_rows(tmp_path):
    version_1 = SCHEMA_V3.split('-- A wallet that pays x402 calls')[0] + \
        SCHEMA_V3.split('-- Small counters:')[1].split('\n', 1)[1].replace(
            'PRAGMA user_version = 3;', 'PRAGMA user_version = 1;')
    db = mp.Database(tmp_path / 'old.db')
    db.migrate(version_1, {})
    db.execute("INSERT INTO accounts (id, name, role, created_at) VALUES ('a1', 'old', 'member', '2026-01-01T00:00:00.000Z')")
    assert db.value("SELECT count(*) FROM sqlite_master WHERE name IN ('x402_payments', 'wallet_accounts')") == 0
    db.migrate()
    assert db.value('PRAGMA user_version') == mp.SCHEMA_VERSION
    assert db.value("SELECT count(*) FROM sqlite_master WHERE name IN ('x402_payments', 'wallet_accounts')") == 2
    assert db.rows('SELECT id, name FROM accounts') == [{'id': 'a1', 'name': 'old'}]
    db.close()


def undo_version_10(conn):
    """Take a database's schema back from version 10 to 9 (migration 10 undone), in the caller's transaction."""
    version = next(conn.execute('PRAGMA schema_version'))[0]
    conn.execute("""DROP TABLE escrow_calls; DROP INDEX jobs_deposit; DROP INDEX payments_scheduled;
        ALTER TABLE jobs DROP COLUMN escrow_deposit_id;
        ALTER TABLE payments DROP COLUMN call_id; ALTER TABLE payments DROP COLUMN executable_at;
        PRAGMA writable_schema = ON;
        UPDATE sqlite_schema SET sql = replace(sql, ', ''reclaim''', '') WHERE type = 'table' AND name = 'payments';
        UPDATE sqlite_schema SET sql = replace(sql, ', ''escrow_calls''', '')
            WHERE type = 'table' AND name = 'signed_transactions';""")
    conn.execute(f'PRAGMA schema_version = {version + 1}')
    conn.execute('PRAGMA writable_schema = OFF')


def undo_version_9(conn):
    """Take a database's schema back from version 9 to 8 (migration 9 undone), in the caller's transaction."""
    version = next(conn.execute('PRAGMA schema_version'))[0]
    conn.execute("""ALTER TABLE jobs DROP COLUMN escrow_unheld; ALTER TABLE agents DROP COLUMN stripe_checked_at;
        ALTER TABLE stripe_events DROP COLUMN reference;
        DROP INDEX x402_payments_tx; ALTER TABLE x402_payments DROP COLUMN call_digest;
        ALTER TABLE disputes DROP COLUMN requester_account; ALTER TABLE disputes DROP COLUMN worker_account;
        ALTER TABLE disputes DROP COLUMN worker_wallet; ALTER TABLE disputes DROP COLUMN payer_wallet;
        PRAGMA writable_schema = ON;
        UPDATE sqlite_schema SET sql = replace(sql, ', ''held'', ''charged_back''', '')
            WHERE type = 'table' AND name = 'jobs';""")
    conn.execute(f'PRAGMA schema_version = {version + 1}')
    conn.execute('PRAGMA writable_schema = OFF')


def version_8_demo(path):
    """The demo fixtures in a database of schema version 8 (seeded now, then taken back to that shape): an open
    connection to it, in a transaction."""
    command_line.seed(mp.Settings(db=str(path)), ROOT / 'fixtures' / 'demo.json', wiring.FACES, out=lambda line: None)
    conn = apsw.Connection(str(path))
    conn.execute('PRAGMA foreign_keys = ON')
    conn.execute('BEGIN')
    undo_version_10(conn)
    undo_version_9(conn)
    conn.execute('PRAGMA user_version = 8')
    return conn


def test_a_version_8_database_takes_held_escrow_and_keeps_its_rows(tmp_path):
    path = tmp_path / 'old.db'
    conn = version_8_demo(path)
    conn.execute('COMMIT')
    jobs = list(conn.execute('SELECT id, status, escrow_status FROM jobs ORDER BY id'))
    schema = next(conn.execute("SELECT sql FROM sqlite_schema WHERE name = 'jobs'"))[0]
    assert 'held' not in schema and 'escrow_unheld' not in schema and len(jobs) == 10
    conn.close()
    db = mp.Database(path)
    db.migrate()
    assert db.value('PRAGMA user_version') == mp.SCHEMA_VERSION == 12
    assert [tuple(row.values()) for row in db.rows('SELECT id, status, escrow_status FROM jobs ORDER BY id')] == jobs
    assert db.value('PRAGMA integrity_check') == 'ok' and db.value('PRAGMA foreign_key_check') is None
    assert mp.ledger_problems(db) == []
    job = jobs[0][0]
    with db.transaction():      # the new values are allowed, and the CHECK still refuses others
        db.execute("UPDATE jobs SET escrow_status = 'held', escrow_unheld = 'locked' WHERE id = :id", {'id': job})
        db.execute("UPDATE jobs SET escrow_status = 'charged_back' WHERE id = :id", {'id': job})
    with pytest.raises(apsw.ConstraintError):
        db.execute("UPDATE jobs SET escrow_status = 'frozen' WHERE id = :id", {'id': job})
    assert {row['stripe_checked_at'] for row in db.rows('SELECT stripe_checked_at FROM agents')} == {None}
    assert db.rows('SELECT reference FROM stripe_events') == []
    db.close()


def version_4_demo(path):
    """The demo fixtures in a database of schema version 4 (seeded now, then taken back to that shape): an open
    connection to it, in a transaction."""
    conn = version_8_demo(path)
    version = next(conn.execute('PRAGMA schema_version'))[0]
    conn.execute("""DROP TABLE webhook_events; DROP INDEX webhook_deliveries_pending;
        ALTER TABLE agents DROP COLUMN webhook_failures; ALTER TABLE agents DROP COLUMN webhook_paused_at;
        DROP TABLE stripe_events; DROP INDEX agents_stripe_account;
        ALTER TABLE jobs DROP COLUMN stripe_session_id; ALTER TABLE jobs DROP COLUMN checkout_url;
        ALTER TABLE jobs DROP COLUMN checkout_expires_at; ALTER TABLE jobs DROP COLUMN payment_intent;
        ALTER TABLE jobs DROP COLUMN stripe_charge; ALTER TABLE payments DROP COLUMN reference;
        ALTER TABLE agents DROP COLUMN stripe_account_id; ALTER TABLE agents DROP COLUMN stripe_payouts_enabled;
        PRAGMA writable_schema = ON;
        UPDATE sqlite_schema SET sql = replace(replace(sql, '''pending_payment'', ', ''), '''pending'', ', '')
            WHERE type = 'table' AND name = 'jobs';""")
    conn.execute(f'PRAGMA schema_version = {version + 1}')
    conn.execute('PRAGMA writable_schema = OFF; PRAGMA user_version = 4;')
    return conn


def test_a_version_4_database_takes_pending_jobs_and_keeps_its_rows(tmp_path):
    path = tmp_path / 'old.db'
    conn = version_4_demo(path)
    conn.execute('COMMIT')
    jobs = list(conn.execute('SELECT id, status, escrow_status FROM jobs ORDER BY id'))
    schema = next(conn.execute("SELECT sql FROM sqlite_schema WHERE name = 'jobs'"))[0]
    assert 'pending' not in schema and len(jobs) == 10
    conn.close()
    db = mp.Database(path)
    db.migrate()
    assert db.value('PRAGMA user_version') == mp.SCHEMA_VERSION == 12
    assert [tuple(row.values()) for row in db.rows('SELECT id, status, escrow_status FROM jobs ORDER BY id')] == jobs
    assert db.value('PRAGMA integrity_check') == 'ok' and db.value('PRAGMA foreign_key_check') is None
    job = jobs[0][0]
    with db.transaction():      # the new values are allowed, and the CHECKs still refuse others
        db.execute("UPDATE jobs SET status = 'pending_payment', escrow_status = 'pending' WHERE id = :id", {'id': job})
    with pytest.raises(apsw.ConstraintError):
        db.execute("UPDATE jobs SET status = 'paid' WHERE id = :id", {'id': job})
    assert db.rows('SELECT stripe_session_id, payment_intent FROM jobs WHERE id = :id', {'id': job}) == \
        [{'stripe_session_id': None, 'payment_intent': None}]
    db.close()


def version_3_demo(path):
    """The demo fixtures in a database of schema version 3 (seeded now, then taken back to that shape)."""
    conn = version_4_demo(path)
    conn.execute('''DROP TABLE dispute_panels;
        ALTER TABLE accounts DROP COLUMN x402_exempt; ALTER TABLE api_keys DROP COLUMN from_env;
        ALTER TABLE jobs DROP COLUMN claim_timeout_hours; ALTER TABLE disputes DROP COLUMN needs_admin;
        CREATE TABLE arbitrators_v3 (id TEXT PRIMARY KEY, account_id TEXT NOT NULL REFERENCES accounts(id),
            agent_id TEXT UNIQUE REFERENCES agents(id), name TEXT NOT NULL, wallet_address TEXT NOT NULL,
            status TEXT NOT NULL CHECK (status IN ('active', 'suspended')), created_at TEXT NOT NULL,
            updated_at TEXT NOT NULL);
        INSERT INTO arbitrators_v3 SELECT id, account_id, agent_id, name, wallet_address,
            CASE status WHEN 'pending' THEN 'active' ELSE status END, created_at, updated_at FROM arbitrators;
        CREATE TABLE votes_v3 (id TEXT PRIMARY KEY, dispute_id TEXT NOT NULL REFERENCES disputes(id),
            arbitrator_id TEXT NOT NULL REFERENCES arbitrators_v3(id), vote TEXT NOT NULL, reasoning TEXT NOT NULL
            DEFAULT '', created_at TEXT NOT NULL, UNIQUE (dispute_id, arbitrator_id));
        INSERT INTO votes_v3 SELECT * FROM votes;
        DROP TABLE votes; DROP TABLE arbitrators;
        ALTER TABLE arbitrators_v3 RENAME TO arbitrators; ALTER TABLE votes_v3 RENAME TO votes;
        CREATE INDEX votes_arbitrator ON votes(arbitrator_id);
        PRAGMA user_version = 3;''')
    conn.execute('COMMIT')
    return conn


def test_a_version_3_database_keeps_its_arbitrators_and_votes_and_agent_arbitrators_wait_for_an_admin(tmp_path):
    path = tmp_path / 'old.db'
    conn = version_3_demo(path)
    account, agent, job, claim = next(conn.execute('''SELECT a.account_id, a.id, c.job_id, c.id FROM claims c
                                                     JOIN agents a ON a.id = c.agent_id LIMIT 1'''))
    moment = '2026-01-01T00:00:00.000Z'
    conn.execute('''INSERT INTO arbitrators VALUES ('r1', :account, :agent, 'farmed', :wallet, 'active', :t, :t),
                        ('r2', :account, NULL, 'a person', :wallet, 'active', :t, :t),
                        ('r3', :account, NULL, 'resting', :wallet, 'suspended', :t, :t);
                    INSERT INTO disputes (id, job_id, claim_id, status, reason, required_votes, created_at)
                        VALUES ('d1', :job, :claim, 'open', 'late', 3, :t);
                    INSERT INTO votes VALUES ('v1', 'd1', 'r1', 'worker', '', :t), ('v2', 'd1', 'r2', 'worker', '', :t)''',
                 {'account': account, 'agent': agent, 'wallet': '0x' + '1' * 40, 't': moment, 'job': job, 'claim': claim})
    before = list(conn.execute('SELECT id, agent_id IS NOT NULL, status FROM arbitrators ORDER BY id'))
    votes = list(conn.execute('SELECT id, dispute_id, arbitrator_id, vote FROM votes ORDER BY id'))
    conn.close()
    assert votes and any(agent for _, agent, _ in before) and any(not agent for _, agent, _ in before)
    db = mp.Database(path)
    db.migrate()
    assert db.value('PRAGMA user_version') == mp.SCHEMA_VERSION == 12
    after = [tuple(row.values()) for row in db.rows('SELECT id, agent_id IS NOT NULL, status, trusted FROM arbitrators ORDER BY id')]
    assert after == [(id_, agent, 'pending' if agent and status == 'active' else status, 0)
                     for id_, agent, status in before]
    assert [tuple(row.values()) for row in db.rows('SELECT id, dispute_id, arbitrator_id, vote FROM votes ORDER BY id')] \
        == votes
    # version 9: the dispute's parties, taken as they are at the migration (CONTRACT.md 20)
    assert db.row("SELECT requester_account, worker_account, worker_wallet, payer_wallet FROM disputes WHERE id = 'd1'") \
        == db.row('''SELECT j.requester_id AS requester_account, a.account_id AS worker_account,
                         a.wallet_address AS worker_wallet, j.refund_address AS payer_wallet
                         FROM jobs j, agents a WHERE j.id = :job AND a.id = :agent''', {'job': job, 'agent': agent})
    assert db.value("SELECT worker_account FROM disputes WHERE id = 'd1'") == account
    assert db.value('PRAGMA foreign_key_check') is None
    assert {row['claim_timeout_hours'] for row in db.rows('SELECT claim_timeout_hours FROM jobs')} == {24}
    assert mp.ledger_problems(db) == []
    db.close()


def test_a_version_3_database_marks_the_admin_key_the_environment_made(tmp_path):
    """So that the first start with another MARKETPLACE_ADMIN_KEY after the upgrade revokes it."""
    path = tmp_path / 'old.db'
    conn = version_3_demo(path)
    old_key = 'old-env-admin-key-' + 'o' * 32
    conn.execute('''INSERT INTO accounts VALUES ('adm', 'admin', 'admin', '2026-01-01T00:00:00.000Z');
                    INSERT INTO api_keys VALUES ('k-env', 'adm', :hash, :prefix, '2026-01-01T00:00:00.000Z', NULL)''',
                 {'hash': mp.hash_key(old_key), 'prefix': old_key[:4] + '…'})
    conn.close()
    app = wiring.make_app(mp.Settings(db=str(path), rate_limits='off', admin_key='new-env-admin-key-' + 'n' * 32))
    try:
        keys = app.service.db.rows('SELECT id, from_env, revoked_at IS NOT NULL AS revoked FROM api_keys')
        assert [(k['from_env'], k['revoked']) for k in keys if k['id'] == 'k-env'] == [(1, 1)]
        assert {(k['from_env'], k['revoked']) for k in keys if k['id'] != 'k-env'} == {(0, 0), (1, 0)}   # seed, new
        assert Client(app).post('/api/jobs/expire', key=old_key).status == 401
    finally:
        app.service.close()


def test_a_version_2_database_gains_job_counts_of_its_jobs_and_the_list_indexes(tmp_path):
    path = tmp_path / 'old.db'
    conn = version_3_demo(path)       # back to version 2: no job_counts, the old status index
    conn.execute('''DROP TABLE job_counts; DROP TRIGGER job_counts_insert; DROP TRIGGER job_counts_delete;
                    DROP TRIGGER job_counts_update; DROP INDEX jobs_status; DROP INDEX jobs_category_status;
                    CREATE INDEX jobs_status_created ON jobs(status, created_at); PRAGMA user_version = 2;''')
    counted = list(conn.execute('SELECT category, status, count(*) FROM jobs GROUP BY 1, 2 ORDER BY 1, 2'))
    conn.close()
    assert len(counted) >= 5 and {status for _, status, _ in counted} >= {'open', 'completed', 'rejected'}
    db = mp.Database(path)
    db.migrate()
    assert db.value('PRAGMA user_version') == mp.SCHEMA_VERSION == 12
    assert [tuple(row.values()) for row in db.rows('SELECT category, status, jobs FROM job_counts ORDER BY 1, 2')] \
        == counted
    indexes = {row['name'] for row in db.rows("SELECT name FROM sqlite_master WHERE type = 'index' AND tbl_name = 'jobs'")}
    assert {'jobs_status', 'jobs_category_status'} <= indexes and 'jobs_status_created' not in indexes
    open_jobs = sum(jobs for _, status, jobs in counted if status == 'open')
    assert mp.find_jobs(db, status='open')[1] == open_jobs        # the total comes from job_counts now
    db.close()


def test_a_new_database_gets_the_schema_without_migrations(tmp_path):
    db = mp.Database(tmp_path / 'new.db')
    not_sql = {'before': 'THIS IS NOT SQL'}
    db.migrate(mp.SCHEMA_SQL, {2: not_sql, 3: not_sql, 4: not_sql, 5: not_sql, 6: not_sql,
                               9: not_sql})     # a new database runs no migration
    assert db.value('PRAGMA user_version') == mp.SCHEMA_VERSION == 12
    db.close()


def test_migration_9_gives_x402_payments_their_call_digest(tmp_path):
    """A version 8 database (x402_payments without call_digest) migrates: its payments keep their rows, with no
    call's digest (so one taken before and never spent pays no call now)."""
    db = mp.Database(tmp_path / 'v8.db')
    db.migrate()
    with db.transaction():
        undo_version_10(db.conn)
        undo_version_9(db.conn)
        db.conn.execute('PRAGMA user_version = 8')
        db.insert('x402_payments', {'id': 'p1', 'form': 'proof', 'endpoint': 'GET /api/jobs/match', 'chain_id': 8453,
                                    'asset': 'USDC', 'payer': '0xpayer', 'amount': 10_000, 'tx_hash': '0xtx',
                                    'status': 'confirmed', 'created_at': mp.now_iso()})
    db.migrate()
    assert db.value('PRAGMA user_version') == 12
    assert db.row('SELECT id, call_digest, granted_at FROM x402_payments') == \
        {'id': 'p1', 'call_digest': None, 'granted_at': None}
    assert db.value("SELECT count(*) FROM sqlite_schema WHERE name = 'x402_payments_tx'") == 1
    db.close()


def test_migration_10_takes_reclaims_escrow_calls_and_deposits_and_keeps_its_rows(tmp_path):
    """A version 9 database (the demo) migrates: its jobs and payments keep their rows with no deposit and nothing
    scheduled, a payment may now be a `reclaim` (the CHECK still refuses others), an escrow call is kept among the
    signed transactions, and a deposit funds one job."""
    path = tmp_path / 'v9.db'
    command_line.seed(mp.Settings(db=str(path)), ROOT / 'fixtures' / 'demo.json', wiring.FACES, out=lambda line: None)
    db = mp.Database(path)
    with db.transaction():
        undo_version_10(db.conn)
        db.conn.execute('PRAGMA user_version = 9')
    payments = db.rows('SELECT id, type, amount FROM payments ORDER BY seq')
    db.migrate()
    assert db.value("PRAGMA user_version") == 12 and len(payments) == 13
    assert db.rows('SELECT id, type, amount FROM payments ORDER BY seq') == payments
    assert db.value('SELECT count(*) FROM payments WHERE call_id IS NOT NULL OR executable_at IS NOT NULL') == 0
    assert db.value('SELECT count(*) FROM jobs WHERE escrow_deposit_id IS NOT NULL') == 0
    job, other = db.rows('SELECT id FROM jobs LIMIT 2')
    with db.transaction():
        mp.record_payment(db, db.row('SELECT * FROM jobs WHERE id = :id', job), 'reclaim', 0, debit='escrow:x',
                          credit='funding:y', recipient='0xpayer')
        db.insert('escrow_calls', {'id': 'c1', 'function': 'propose', 'deposit_id': '0x01', 'job_id': job['id'],
                                   'status': 'pending', 'tx_hash': '0xaa', 'raw_tx': '0xbb', 'nonce': 7,
                                   'created_at': mp.now_iso()})
        db.execute("UPDATE jobs SET escrow_deposit_id = '0x01' WHERE id = :id", job)
    assert db.row("SELECT source, payment_id, nonce FROM signed_transactions WHERE tx_hash = '0xaa'") == \
        {'source': 'escrow_calls', 'payment_id': 'c1', 'nonce': 7}
    with pytest.raises(apsw.ConstraintError):
        db.execute("UPDATE jobs SET escrow_deposit_id = '0x01' WHERE id = :id", other)
    with pytest.raises(apsw.ConstraintError):
        db.execute("UPDATE payments SET type = 'gift' WHERE type = 'reclaim'")
    assert db.value('PRAGMA integrity_check') == 'ok'
    db.close()


def test_widening_a_check_refuses_a_schema_it_does_not_know(tmp_path):
    """widen_checks edits a CHECK's text in place; a table whose text is not the expected one stops the migration."""
    db = mp.Database(tmp_path / 'odd.db')
    db.execute("CREATE TABLE things (status TEXT CHECK (status IN ('a', 'b')))")
    with pytest.raises(RuntimeError, match="no \\('a', 'c'\\)"):
        with db.transaction():
            migrations.widen_checks(db, 'things', ("('a', 'c')", "('a', 'c', 'd')"))
    with db.transaction():
        migrations.widen_checks(db, 'things', ("('a', 'b')", "('a', 'b', 'c')"))
    db.execute("INSERT INTO things VALUES ('c')")
    with pytest.raises(apsw.ConstraintError):
        db.execute("INSERT INTO things VALUES ('d')")
    assert db.value('PRAGMA integrity_check') == 'ok'
    db.close()


def test_a_version_5_database_keeps_the_hashes_of_its_signed_payouts(tmp_path):
    """Migration 6: the transactions signed before it are the first rows of signed_transactions, so a payout
    re-priced after the upgrade is still confirmed by its first hash if that one is mined."""
    path = tmp_path / 'old.db'
    version_4_demo(path).close()
    db = mp.Database(path)
    db.migrate()
    job = db.value('SELECT id FROM jobs LIMIT 1')
    with db.transaction():
        undo_version_10(db.conn)
        db.conn.execute('''DROP TRIGGER payments_signed; DROP TRIGGER payments_resigned;
                           DROP TRIGGER x402_payments_signed; DROP TRIGGER x402_payments_resigned;
                           DROP TABLE signed_transactions; DROP TABLE webhook_events;
                           DROP INDEX webhook_deliveries_pending; ALTER TABLE agents DROP COLUMN webhook_failures;
                           ALTER TABLE agents DROP COLUMN webhook_paused_at; PRAGMA user_version = 5;''')
        undo_version_9(db.conn)
        db.insert('payments', {'id': 'p1', 'job_id': job, 'type': 'refund', 'amount': 0, 'currency': 'USDC',
                               'rail': 'base', 'status': 'pending', 'recipient': '0x' + '1' * 40,
                               'tx_hash': '0x' + 'ab' * 32, 'raw_tx': '0x02f8', 'nonce': 4,
                               'created_at': '2026-01-01T00:00:00.000Z'})
    db.close()
    db = mp.Database(path)
    db.migrate()
    assert db.value('PRAGMA user_version') == mp.SCHEMA_VERSION == 12
    assert db.rows('SELECT tx_hash, source, payment_id, nonce, raw_tx FROM signed_transactions') == \
        [{'tx_hash': '0x' + 'ab' * 32, 'source': 'payments', 'payment_id': 'p1', 'nonce': 4, 'raw_tx': '0x02f8'}]
    db.close()


def test_a_version_8_database_ends_its_sessions_and_demotes_the_retired_env_admin_keys_accounts(tmp_path):
    """Migration 9: a session made before names no key, so it ends (sign in again); the account of an env admin
    key revoked when MARKETPLACE_ADMIN_KEY changed is a member, the live env key's and `keys create --admin`'s stay
    admins."""
    path = tmp_path / 'v8.db'
    db = mp.Database(path)
    db.migrate()
    retired, _ = mp.create_account(db, 'retired', 'admin')
    live, _ = mp.create_account(db, 'live', 'admin')
    made, _ = mp.create_account(db, 'made', 'admin')
    with db.transaction():
        db.execute("UPDATE api_keys SET from_env = 1, revoked_at = '2026-01-01T00:00:00.000Z' WHERE account_id = :id",
                   {'id': retired['id']})
        db.execute('UPDATE api_keys SET from_env = 1 WHERE account_id = :id', {'id': live['id']})
        undo_version_10(db.conn)
        undo_version_9(db.conn)
        db.conn.execute('''DROP TABLE sessions;
            CREATE TABLE sessions (id_hash TEXT PRIMARY KEY, account_id TEXT NOT NULL REFERENCES accounts(id),
                                   created_at TEXT NOT NULL, seen_at TEXT NOT NULL, expires_at TEXT NOT NULL);
            CREATE INDEX sessions_seen ON sessions(seen_at);
            PRAGMA user_version = 8;''')
        db.insert('sessions', {'id_hash': 'ab' * 32, 'account_id': retired['id'], 'created_at': mp.now_iso(),
                               'seen_at': mp.now_iso(), 'expires_at': '2099-01-01T00:00:00.000Z'})
    db.close()
    db = mp.Database(path)
    db.migrate()
    assert db.value('PRAGMA user_version') == mp.SCHEMA_VERSION == 12
    assert db.value('SELECT count(*) FROM sessions') == 0
    assert 'key_id' in [row['name'] for row in db.rows("SELECT name FROM pragma_table_info('sessions')")]
    assert [(row['name'], row['role']) for row in db.rows('SELECT name, role FROM accounts ORDER BY name')] == \
        [('live', 'admin'), ('made', 'admin'), ('retired', 'member')]
    assert db.value('PRAGMA integrity_check') == 'ok' and db.value('PRAGMA foreign_key_check') is None
    db.close()
