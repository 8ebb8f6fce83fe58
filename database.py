"""The database file is the state: two apsw connections to SQLite (WAL, FTS5), schema.sql and its migrations by
PRAGMA user_version, group commit, the generation that the read cache keys by, and a read replica's view through
Litestream's extension. The rules (marketplace.py) hold the SQL of every operation; this module knows tables, not
jobs. Below the rules: it imports nothing of them (errors.py's two answers aside)."""

import logging
import re
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import apsw

import replication
from errors import CommitFailed, ReadOnlyReplica
from migrations import MIGRATIONS

HERE = Path(__file__).resolve().parent
log = logging.getLogger('marketplace')


SCHEMA_SQL = (HERE / 'schema.sql').read_text()


def schema_version(schema_sql):
    """The user_version a schema brings a database to (its `PRAGMA user_version = N` line)."""
    return int(re.search(r'PRAGMA user_version = (\d+);', schema_sql).group(1))


SCHEMA_VERSION = schema_version(SCHEMA_SQL)


GROUP_COMMIT_MAX = 256      # transactions in one group commit at most: a steady stream of writers still commits


class CommitGroup:
    """The write transactions that one COMMIT makes durable together: how many, when it is done, and its failure."""

    def __init__(self):
        self.members = 0
        self.done = threading.Event()       # gevent's under the server (monkey-patched)
        self.error = None


# Tables whose rows no cached answer shows (read_cache.py), or that change only beside a table that advances the
# generation in the same transaction (job_counts with jobs, ledger_entries with payments): their writes leave it.
GENERATION_IGNORED = {'generation', 'api_keys', 'sessions', 'idempotency_keys', 'chain_state', 'webhook_events',
                      'webhook_deliveries', 'signed_transactions', 'oauth_clients', 'oauth_grants', 'oauth_codes',
                      'oauth_tokens', 'a2a_tasks', 'job_counts', 'ledger_entries'}


def generation_triggers(conn):
    """The triggers that advance the generation in the transaction of every change to any other table (none
    while the schema has no generation: an older schema, in the migration tests)."""
    tables = [name for (name,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table' AND sql LIKE "
                                               "'CREATE TABLE%' AND name NOT LIKE 'sqlite%' AND name NOT LIKE '%fts%'")]
    tables = [name for name in tables if name not in GENERATION_IGNORED] if 'generation' in tables else []
    return ''.join(f'CREATE TRIGGER IF NOT EXISTS generation_{table}_{op.lower()} AFTER {op} ON {table} BEGIN '
                   'UPDATE generation SET n = n + 1; END;\n' for table in tables for op in ('INSERT', 'UPDATE', 'DELETE'))


class Database:
    """Two apsw connections with WAL, synchronous=FULL, foreign keys and a busy timeout: `conn` writes, `reads`
    reads what is committed. `replicated` leaves the checkpoints to Litestream (no automatic checkpoint here),
    which must copy every WAL frame before it goes.

    Writes are group-committed. Each transaction runs in its own savepoint inside the open group transaction
    (one at a time: the writer lock), so a failing one rolls back only itself. When it ends, the group commits
    at once if no other transaction waits for the lock (a lone write waits for nothing), else the last of those
    waiting commits it: one fsync for all, and each transaction returns only once the COMMIT holding it is
    durable (a failed COMMIT fails every member). Under the server the COMMIT runs on a native thread of its own
    (commit_thread: nothing else runs there, neither name lookups nor chain or Stripe calls, so none of them can
    make a commit wait), and the process keeps reading requests meanwhile; the writer lock keeps everyone else off
    `conn` till it ends.

    Reads outside a transaction go to `reads` and see committed data only; inside one (or under hold), to
    `conn`, which sees the transaction's own writes. SQLite calls never yield to gevent, so a transaction runs
    whole without interleaving as long as it does no network I/O and no sleep. The one that may (a paid x402
    call runs its handler inside the transaction that consumes the payment, and a handler may wait on the node)
    holds the writer lock meanwhile: other greenlets' transactions wait for it.
    """

    read_only = False       # a ReplicaDatabase is

    def __init__(self, path, replicated=False):
        self.path = str(path)
        self.conn = self.connect(self.path, replicated)
        self.conn.execute('PRAGMA journal_mode = WAL')
        self.reads = self.connect(self.path, replicated)
        self.reads.execute('PRAGMA query_only = ON')       # a write through it would escape the writer lock
        self.nobody_writing()

    def nobody_writing(self):
        """The writer lock and the group commit's state, before anyone writes."""
        self._depth = 0         # of the writer's transaction (0: none, or held open between them)
        self._owner = None      # the thread (greenlet under the server) that has the writer lock
        self._writer = threading.RLock()     # gevent's under the server (monkey-patched)
        self._waiting = 0       # transactions waiting for the writer lock
        self._counting = threading.Lock()
        self._group = None      # the open group transaction
        self._local = threading.local()     # hold() and after_commit(): per greenlet (per thread in-process)
        self.commits = self.grouped = 0     # COMMITs made, and the transactions they held (logged at the end)
        from gevent import monkey
        self.commit_in_thread = monkey.is_module_patched('threading')
        self._commit_pool = None    # commit_thread's

    @staticmethod
    def connect(path, replicated=False):
        """One connection to the file (Database.prepare); replicated, with no automatic checkpoint."""
        conn = Database.prepare(apsw.Connection(path))
        if replicated:
            conn.execute('PRAGMA wal_autocheckpoint = 0')
        return conn

    @staticmethod
    def prepare(conn):
        """A connection as every query expects it: synchronous=FULL, foreign keys, busy timeout, no double-quoted
        strings, temporary data in memory, Python's lower()."""
        conn.set_busy_timeout(5000)        # also while Litestream checkpoints or takes its read lock
        conn.config(apsw.SQLITE_DBCONFIG_DQS_DML, 0)
        conn.config(apsw.SQLITE_DBCONFIG_DQS_DDL, 0)
        conn.execute('PRAGMA synchronous = FULL')
        conn.execute('PRAGMA foreign_keys = ON')
        # Savepoint journals in memory: each write transaction is a savepoint of its group, and SQLite copies every
        # page it first changes there (~40 a job post); on disk past 64 KiB, that was 70 more pwrite calls a post.
        conn.execute('PRAGMA temp_store = MEMORY')
        conn.create_scalar_function('unicode_lower', lambda text: text.lower() if isinstance(text, str) else text,
                                    1, deterministic=True)       # Python's lower(); SQLite's folds ASCII only
        return conn

    def migrate(self, schema_sql=SCHEMA_SQL, migrations=MIGRATIONS):
        """Bring the database to the schema's version in one transaction: each pending migration's
        `before`, then the schema (idempotent), then each pending migration's `after`."""
        latest = schema_version(schema_sql)
        with self.transaction():
            version = self.value('PRAGMA user_version')
            if version > latest:
                raise RuntimeError(f'{self.path} has schema version {version}, newer than this '
                                   f'program ({latest}); upgrade marketplace.py')
            pending = [migrations[target] for target in range(version + 1, latest + 1)] if version else []
            for migration in pending:
                before = migration.get('before', '')
                before(self) if callable(before) else self.conn.execute(before)
            self.conn.execute(schema_sql)
            for migration in pending:
                self.conn.execute(migration.get('after', ''))
            self.conn.execute(generation_triggers(self.conn))

    def writing(self):
        """Does this greenlet (thread in-process) have the writer: inside a transaction, or holding one open?"""
        return self._owner == threading.get_ident()

    @contextmanager
    def transaction(self):
        """One write transaction, in its own savepoint of the group transaction, durable when it returns; inner
        uses in the same greenlet join the outer one. Another greenlet waits for it to end (the lock), so one that
        yields inside a transaction (a paid x402 call) never mixes its writes with another's. Under hold(), the
        first one that ends well stays open, and the later ones are savepoints in it."""
        if self.writing():
            if self._depth:
                self._depth += 1
                try:
                    yield self
                finally:
                    self._depth -= 1
                return
            with self.savepoint('inner'):       # in the transaction held open
                yield self
            return
        self.take_writer()
        try:
            group = self._group
            if group is None:
                self.conn.execute('BEGIN IMMEDIATE')
                group = self._group = CommitGroup()
            self.conn.execute('SAVEPOINT member')
            self._depth = 1
            try:
                yield self
            except BaseException:
                self._depth = 0
                self._local.after = []
                self.undo_member()
                raise
            self._depth = 0
            if self.held_state() == 'waiting':      # held since it began, or from inside it (a paid call)
                self._local.hold = 'open'       # kept, with the writer lock and the savepoint, until end_hold
                return
            self.conn.execute('RELEASE member')
            group.members += 1
        finally:
            if self.held_state() != 'open':
                self.give_writer()
        self.await_commit(group)

    @contextmanager
    def savepoint(self, name):
        """A savepoint in the writer's open transaction: released if the block ends well, else rolled back."""
        self.conn.execute(f'SAVEPOINT {name}')
        self._depth = 1
        try:
            yield
        except BaseException:
            self._depth = 0
            self.conn.execute(f'ROLLBACK TO {name}; RELEASE {name}')
            raise
        self._depth = 0
        self.conn.execute(f'RELEASE {name}')

    def take_writer(self):
        """Wait for the writer lock, counted among those waiting (whom a group's COMMIT waits for)."""
        with self._counting:
            self._waiting += 1
        try:
            self._writer.acquire()
        except BaseException:       # killed while waiting: the group it was to commit must not wait for it
            with self._counting:
                self._waiting -= 1
            if self._writer.acquire(blocking=False):
                self._owner = threading.get_ident()
                self.give_writer()
            raise
        with self._counting:
            self._waiting -= 1
        self._owner = threading.get_ident()

    def give_writer(self):
        """Let the writer lock go; first commit the group if nobody waits to join it (or it is full)."""
        group = self._group
        try:
            if group is not None and (not self._waiting or group.members >= GROUP_COMMIT_MAX):
                self._group = None
                self.commit_group(group)
        finally:
            self._owner = None
            self._writer.release()

    def undo_member(self):
        """Roll back the failed transaction's savepoint; the group fails whole when SQLite rolled it all back."""
        group = self._group
        if self.conn.in_transaction:
            self.conn.execute('ROLLBACK TO member; RELEASE member')
        elif group is not None:     # an I/O error or a full disk ends the whole transaction in SQLite
            self._group = None
            group.error = RuntimeError('the group transaction was rolled back by SQLite')
            group.done.set()

    def commit_group(self, group):
        """COMMIT the group and wake its members; ROLLBACK all if that fails. A kill that comes while the COMMIT
        runs in its thread is raised once the COMMIT has ended (and the members know how)."""
        error = interruption = None
        try:
            if group.members:
                error, interruption = self.durable_commit()
            else:
                self.conn.execute('ROLLBACK')       # every member failed: nothing to make durable
        except BaseException as exc:
            error = exc
        if error is None:
            self.commits += (1 if group.members else 0)
            self.grouped += group.members
        else:
            group.error = error
            log.error('a group commit of %d transactions failed, none applied: %r', group.members, error)
            if self.conn.in_transaction:
                self.conn.execute('ROLLBACK')
        group.done.set()
        if interruption is not None:
            raise interruption

    def durable_commit(self):
        """COMMIT with its fsync: (its error, what interrupted the wait for it), each None if nothing did. Under the
        server it runs in a real thread, apsw releasing the GIL, so the hub runs on; the wait outlasts any kill,
        since nobody may touch the connection before the COMMIT returns."""
        if not self.commit_in_thread:
            try:
                self.conn.execute('COMMIT')
            except apsw.Error as exc:
                return exc, None
            return None, None
        done, interruption = self.commit_thread().spawn(self.conn.execute, 'COMMIT'), None
        while not done.ready():
            try:
                done.wait()
            except BaseException as exc:        # GreenletExit, a Timeout: after the COMMIT
                interruption = interruption or exc
        return (None if done.successful() else done.exception), interruption

    def commit_thread(self):
        """The one native thread that runs this database's COMMITs, and nothing else (made on first use): gevent's
        own pool also resolves host names, and a slow resolver there made every write wait (CONTRACT.md 20)."""
        if self._commit_pool is None:
            from gevent.threadpool import ThreadPool
            self._commit_pool = ThreadPool(1)
        return self._commit_pool

    def await_commit(self, group):
        """Return once the group's COMMIT is durable, then run what after_commit put off; raise if it failed."""
        group.done.wait()
        after, self._local.after = getattr(self._local, 'after', []), []
        if group.error is not None:
            raise CommitFailed(headers={'Retry-After': '1'}) from group.error
        for work in after:
            work()

    def held_state(self):
        """This greenlet's hold: None, 'waiting' (for its first transaction) or 'open' (that transaction)."""
        return getattr(self._local, 'hold', None)

    def hold(self):
        """From now on in this greenlet, the outermost transaction that ends well does not commit: it stays open
        (with the writer lock) for the later ones to join, until end_hold commits it with one last write (an
        Idempotency-Key's answer stored in the transaction of the change it answers)."""
        if self.held_state() is None:
            self._local.hold = 'waiting'

    def end_hold(self, last=None):
        """Run `last(db)` in the held transaction (or in a transaction of its own when none was opened), commit
        (with the group), then what after_commit put off. An exception rolls back everything held, and is raised."""
        state = self.held_state()
        self._local.hold = None
        if state != 'open':
            if last is not None:
                with self.transaction():
                    last(self)
            else:
                self._local.after, after = [], getattr(self._local, 'after', [])
                for work in after:
                    work()
            return
        group = self._group
        try:
            try:
                if last is not None:
                    self._depth = 1
                    last(self)
            except BaseException:
                self.undo_member()
                self._local.after = []
                raise
            finally:
                self._depth = 0
            self.conn.execute('RELEASE member')
            group.members += 1
        finally:
            self.give_writer()
        self.await_commit(group)

    def after_commit(self, work):
        """Run `work()` now, or, inside a transaction of this greenlet (or one it holds open), once it is durable."""
        if self.writing():
            if not hasattr(self._local, 'after'):
                self._local.after = []
            self._local.after.append(work)
        else:
            work()

    def let_others_in(self):
        """Yield to other greenlets between transactions, unless this one holds a transaction open: they would
        wait for its writer lock anyway."""
        if self.held_state() != 'open':
            time.sleep(0)

    def reader(self):
        """The connection this greenlet reads with: the writer's inside its transactions, else the reading one."""
        return self.conn if self.writing() else self.reads

    def rows(self, sql, params=None):
        """Every row of a query as a dict."""
        cursor = self.reader().execute(sql, params or {})
        try:
            names = [d[0] for d in cursor.get_description()]
        except apsw.ExecutionCompleteError:
            return []
        return [dict(zip(names, row)) for row in cursor]

    def row(self, sql, params=None):
        """The first row of a query as a dict, or None."""
        found = self.rows(sql, params)
        return found[0] if found else None

    def value(self, sql, params=None):
        """The first column of the first row, or None."""
        for row in self.reader().execute(sql, params or {}):
            return row[0]
        return None

    def execute(self, sql, params=None):
        """Run one write statement (in a transaction of its own outside one); the number of rows it changed."""
        if not self.writing():
            with self.transaction():
                return self.execute(sql, params)
        self.conn.execute(sql, params or {})
        return self.conn.changes()

    def insert(self, table, values, returning=False):
        """Insert a dict as a row of a table named by the code, never by a caller; with `returning`, the row as
        stored (its defaults and rowid too) as a dict."""
        if not self.writing():
            with self.transaction():
                return self.insert(table, values, returning)
        names = ', '.join(values)
        marks = ', '.join(':' + name for name in values)
        cursor = self.conn.execute(f'INSERT INTO {table} ({names}) VALUES ({marks})'
                                   + (' RETURNING *' if returning else ''), values)
        if returning:
            columns = [column[0] for column in cursor.get_description()]
            return dict(zip(columns, next(cursor)))

    def backup(self, destination):
        """Copy the live database to a file, page by page, while it stays in use."""
        target = apsw.Connection(str(destination))
        try:
            with target.backup('main', self.reads, 'main') as copy:
                while not copy.done:
                    copy.step(256)
        finally:
            target.close()

    def close(self):
        self.reads.close()
        self.conn.close()
        if self._commit_pool is not None:
            self._commit_pool.kill()


class ReplicaDatabase(Database):
    """The primary's database read in place from its Litestream replica (--read-replica-of), through the
    litestream-vfs extension (replication.open_read_replica): read-only, a few seconds behind. Nothing here writes;
    a transaction is refused with 503 read_only (a write that reached a replica's code is a bug, never a change)."""

    read_only = True

    def __init__(self, url):
        self.url, self.path = url, replication.public_url(url)
        self.conn = self.reads = self.prepare(replication.open_read_replica(url))     # its one connection
        self.nobody_writing()

    def reopen(self):
        """A new view of the replica: a new connection through the extension, reading the replica as it is now,
        in place of the old one (closed). The extension reads the replica while it opens, for as long as the store
        takes: under the server that runs on a thread of gevent's pool, and the server goes on answering (from the
        old view, or refusing while it lags). The swap itself never meets a query half-way: SQLite calls never
        yield to gevent."""
        from gevent import monkey
        if monkey.is_module_patched('threading'):
            import gevent
            conn = gevent.get_hub().threadpool.apply(replication.open_read_replica, (self.url,))
        else:
            conn = replication.open_read_replica(self.url)
        old, self.conn = self.conn, self.prepare(conn)
        self.reads = self.conn
        old.close()

    def close(self):
        self.conn.close()

    @contextmanager
    def transaction(self):
        raise ReadOnlyReplica()
        yield self      # a generator, as Database.transaction is
