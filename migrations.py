"""How a database file made by an earlier version becomes this version's.

MIGRATIONS, by the SQLite user_version each brings a database to, is what Database.migrate (marketplace.py) runs
around schema.sql. A migration touches tables only: it knows nothing of the marketplace's rules and imports none.
"""

# Changes to an existing database, by the user_version they bring it to. schema.sql always holds the
# latest shape and creates what is missing; a migration's `before` SQL runs ahead of it (ALTERs that
# schema.sql's indexes need) and its `after` SQL behind it (filling what schema.sql just created).
MIGRATIONS = {
    2: {},      # x402: the tables wallet_accounts and x402_payments, which schema.sql creates
    3: {        # lists: indexes per filter and sort, and job_counts (kept by triggers) for their totals
        'before': 'DROP INDEX IF EXISTS jobs_status_created;',
        'after': '''DELETE FROM job_counts;
                    INSERT INTO job_counts (category, status, jobs)
                        SELECT category, status, count(*) FROM jobs GROUP BY category, status;''',
    },
    4: {        # money that cannot be taken (CONTRACT 18): exempt accounts, env admin keys, claim time-outs,
                # panels; arbitrators gain `pending` (their CHECK widened in place: see widen_checks) and
                # `trusted`. Agent arbitrators made under the old rules wait for an admin again: ten cheap jobs
                # made them arbitrators.
        'before': lambda db: (
            widen_checks(db, 'arbitrators', ("('active', 'suspended')", "('pending', 'active', 'suspended')")),
            db.conn.execute('''
                ALTER TABLE accounts ADD COLUMN x402_exempt INTEGER NOT NULL DEFAULT 0;
                ALTER TABLE api_keys ADD COLUMN from_env INTEGER NOT NULL DEFAULT 0;
                UPDATE api_keys SET from_env = 1 WHERE prefix LIKE '%…';   -- ensure_admin_key's prefix: 'abcd…'
                ALTER TABLE jobs ADD COLUMN claim_timeout_hours INTEGER NOT NULL DEFAULT 24;
                ALTER TABLE disputes ADD COLUMN needs_admin INTEGER NOT NULL DEFAULT 0;
                ALTER TABLE arbitrators ADD COLUMN trusted INTEGER NOT NULL DEFAULT 0;
                UPDATE arbitrators SET status = 'pending' WHERE status = 'active' AND agent_id IS NOT NULL;''')),
    },
    5: {        # the stripe rail for real (CONTRACT 12): jobs gain `pending_payment` and escrow `pending` (CHECKs
                # widened in place), Stripe ids on jobs, payments and agents; schema.sql adds stripe_events
        'before': lambda db: (
            widen_checks(db, 'jobs', ("('open', 'claimed',", "('pending_payment', 'open', 'claimed',"),
                         ("('locked', 'released', 'refunded')", "('pending', 'locked', 'released', 'refunded')")),
            db.conn.execute('''
                ALTER TABLE jobs ADD COLUMN stripe_session_id TEXT;
                ALTER TABLE jobs ADD COLUMN checkout_url TEXT;
                ALTER TABLE jobs ADD COLUMN checkout_expires_at TEXT;
                ALTER TABLE jobs ADD COLUMN payment_intent TEXT;
                ALTER TABLE jobs ADD COLUMN stripe_charge TEXT;
                ALTER TABLE payments ADD COLUMN reference TEXT;
                ALTER TABLE agents ADD COLUMN stripe_account_id TEXT;
                ALTER TABLE agents ADD COLUMN stripe_payouts_enabled INTEGER NOT NULL DEFAULT 0;''')),
    },
    6: {        # staying up under abuse (CONTRACT 19): webhook failures in a row and the pause on agents; schema.sql
                # adds webhook_events (the fan-out outbox), the index of pending deliveries by agent, and
                # signed_transactions with its triggers (payouts re-priced with the same nonce), whose first rows
                # are the transactions signed before
        'before': '''
            ALTER TABLE agents ADD COLUMN webhook_failures INTEGER NOT NULL DEFAULT 0;
            ALTER TABLE agents ADD COLUMN webhook_paused_at TEXT;''',
        'after': '''INSERT OR IGNORE INTO signed_transactions (tx_hash, source, payment_id, nonce, raw_tx)
                        SELECT tx_hash, 'payments', id, nonce, raw_tx FROM payments WHERE raw_tx IS NOT NULL
                        ORDER BY seq;
                    INSERT OR IGNORE INTO signed_transactions (tx_hash, source, payment_id, nonce, raw_tx)
                        SELECT tx_hash, 'x402_payments', id, nonce, raw_tx FROM x402_payments
                        WHERE raw_tx IS NOT NULL ORDER BY seq;''',
    },
    7: {},      # idempotency keys (CONTRACT 14): schema.sql adds idempotency_keys, nothing else changes
    8: {},      # browser sessions (issue 23): schema.sql adds sessions, nothing else changes
    9: {        # round 3 (CONTRACT 20): see migrate_to_9; the admins of retired env keys become members
        'before': lambda db: migrate_to_9(db),       # defined below, with the helpers it uses
        'after': '''UPDATE accounts SET role = 'member' WHERE role = 'admin'
                        AND id IN (SELECT account_id FROM api_keys WHERE from_env = 1 AND revoked_at IS NOT NULL)
                        AND id NOT IN (SELECT account_id FROM api_keys WHERE from_env = 1 AND revoked_at IS NULL);''',
    },
    10: {       # the JobEscrow contract (CONTRACT 21): a job's deposit, payments `reclaim` (the CHECK widened in
                # place) and `scheduled` (their proposal and when it may run), escrow calls among the signed
                # transactions; schema.sql adds escrow_calls with its triggers and the unique index of deposits
        'before': lambda db: (
            widen_checks(db, 'payments', ("'refund', 'fee')", "'refund', 'fee', 'reclaim')")),
            widen_checks(db, 'signed_transactions', ("('payments', 'x402_payments')",
                                                     "('payments', 'x402_payments', 'escrow_calls')")),
            add_missing_column(db, 'jobs', 'escrow_deposit_id', 'TEXT'),
            add_missing_column(db, 'payments', 'call_id', 'TEXT'),
            add_missing_column(db, 'payments', 'executable_at', 'TEXT')),
    },
    11: {},     # agents connect by URL (CONTRACT 22): schema.sql adds the oauth_ tables and a2a_tasks, nothing else
    12: {       # round 4 (CONTRACT 25): why a job needs an admin, a claim's co-signed Release, why a payment failed and
                # who made it, a relayed deposit's payer; schema.sql adds escrow_events, the one-relay-a-payer index
                # and the indexes by which never-approved OAuth clients are deleted
        'before': lambda db: (
            add_missing_column(db, 'jobs', 'needs_admin', 'TEXT'),
            add_missing_column(db, 'claims', 'release_authorization', 'TEXT'),
            add_missing_column(db, 'payments', 'failure', 'TEXT'),
            add_missing_column(db, 'payments', 'origin', 'TEXT'),
            add_missing_column(db, 'escrow_calls', 'payer', 'TEXT')),
        # A payout that reverted now counts for nothing (its two entries reversed) and its job needs an admin.
        'after': '''INSERT INTO ledger_entries (payment_id, job_id, account, amount, currency, created_at)
                        SELECT e.payment_id, e.job_id, e.account, -e.amount, e.currency, e.created_at
                        FROM ledger_entries e JOIN payments p ON p.id = e.payment_id WHERE p.status = 'failed'
                        AND (SELECT count(*) FROM ledger_entries x WHERE x.payment_id = p.id) = 2 ORDER BY e.id;
                    UPDATE payments SET failure = 'its transaction reverted on chain'
                        WHERE status = 'failed' AND failure IS NULL;
                    UPDATE jobs SET needs_admin = 'a payout reverted on chain'
                        WHERE needs_admin IS NULL AND id IN (SELECT job_id FROM payments WHERE status = 'failed');''',
    },
}


def migrate_to_9(db):
    """Round 3 (CONTRACT 20), before schema.sql runs.
    - x402 payments bound to their call: the digest of the call a payment was accepted for. A payment taken before
      has none: if its call never answered below 400, no call may spend it now.
    - A dispute stores its parties' accounts and wallets when it opens; those of the disputes already there are
      taken as they are now (wallets cannot change under an open dispute from this version on).
    - Card money that goes back: escrow `held` and `charged_back` (the CHECK widened in place), the status a held
      escrow returns to, when a sweep last asked Stripe for a connected account, and the Stripe object a recorded
      event is about.
    - Sessions bound to their key: a session made before names no key, so it ends (people sign in again);
      schema.sql makes the table anew with key_id."""
    add_missing_column(db, 'x402_payments', 'call_digest', 'TEXT')
    for column in ('requester_account', 'worker_account', 'worker_wallet', 'payer_wallet'):
        add_missing_column(db, 'disputes', column, 'TEXT')
    db.conn.execute('''UPDATE disputes SET (requester_account, worker_account, worker_wallet, payer_wallet) =
                           (SELECT j.requester_id, a.account_id, a.wallet_address, j.refund_address
                            FROM claims c JOIN jobs j ON j.id = c.job_id JOIN agents a ON a.id = c.agent_id
                            WHERE c.id = disputes.claim_id)''')
    widen_checks(db, 'jobs', ("('pending', 'locked', 'released', 'refunded')",
                              "('pending', 'locked', 'released', 'refunded', 'held', 'charged_back')"))
    add_missing_column(db, 'jobs', 'escrow_unheld', 'TEXT')
    add_missing_column(db, 'agents', 'stripe_checked_at', 'TEXT')
    add_missing_column(db, 'stripe_events', 'reference', 'TEXT')   # older than 5: schema.sql makes it whole
    db.conn.execute('DROP TABLE IF EXISTS sessions')


def add_missing_column(db, table, column, definition):
    """ALTER TABLE ADD COLUMN in a migration, if the table exists without the column (schema.sql makes a missing
    table whole, and a database built from a later schema.sql has the column already)."""
    columns = [row['name'] for row in db.rows(f'PRAGMA table_info({table})')]
    if columns and column not in columns:
        db.conn.execute(f'ALTER TABLE {table} ADD COLUMN {column} {definition}')


def widen_checks(db, table, *replacements):
    """Let a table's CHECKs take more values in an existing database: each (old, new) text is replaced in its
    schema, as SQLite documents for changes that every existing row still satisfies. A CHECK cannot be altered, and
    rebuilding a table that others reference (jobs, with its FTS and count triggers; arbitrators, with votes) would
    mean rebuilding them too. A schema without the old text refuses to migrate; a table not there yet is left to
    schema.sql, which makes it whole."""
    sql = db.value("SELECT sql FROM sqlite_schema WHERE type = 'table' AND name = :table", {'table': table})
    if sql is None:
        return
    for old, new in replacements:
        if old not in sql:
            raise RuntimeError(f'migration: the {table} table has no {old} to widen; its schema is not as expected')
        sql = sql.replace(old, new, 1)
    version = db.value('PRAGMA schema_version')
    db.conn.execute('PRAGMA writable_schema = ON')
    db.execute("UPDATE sqlite_schema SET sql = :sql WHERE type = 'table' AND name = :table", {'sql': sql, 'table': table})
    db.conn.execute(f'PRAGMA schema_version = {version + 1}')
    db.conn.execute('PRAGMA writable_schema = OFF')
