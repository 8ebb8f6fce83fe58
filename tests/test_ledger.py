"""The double-entry ledger: it balances after every operation, and the check catches each way it can break."""

import pytest

import marketplace as mp


def entries(app, job):
    return app.service.db.rows('SELECT account, amount, currency FROM ledger_entries WHERE job_id = :id ORDER BY id',
                               {'id': job['id']})


def test_a_job_locks_its_price_from_the_requester(app, market):
    job = market.job(paymentAmount='25.00')
    assert entries(app, job) == [
        {'account': f'funding:{market.requester["id"]}', 'amount': -25_000_000, 'currency': 'USDC'},
        {'account': f'escrow:{job["id"]}', 'amount': 25_000_000, 'currency': 'USDC'},
    ]
    assert mp.escrow_balance(app.service.db, job['id']) == 25_000_000


def test_usd_is_kept_in_cents(app, market):
    job = market.job(paymentAmount='60.10', paymentCurrency='USD')
    assert [e['amount'] for e in entries(app, job)] == [-6010, 6010]
    assert market.get_job(job)['payments'][0]['amount'] == '60.10'


def test_release_moves_escrow_to_the_worker(app, market):
    job, claim = market.delivered_job(paymentAmount='25.00')
    market.verify(job, claim, True)
    assert entries(app, job)[2:] == [
        {'account': f'escrow:{job["id"]}', 'amount': -25_000_000, 'currency': 'USDC'},
        {'account': f'worker:{market.agent["id"]}', 'amount': 25_000_000, 'currency': 'USDC'},
    ]
    assert mp.escrow_balance(app.service.db, job['id']) == 0
    assert mp.ledger_problems(app.service.db) == []


def test_rejection_returns_the_money_to_the_requester(app, market):
    job, claim = market.delivered_job(paymentAmount='12.34')
    market.verify(job, claim, False)
    balances = {row['account']: row['total'] for row in app.service.db.rows(
        'SELECT account, sum(amount) AS total FROM ledger_entries GROUP BY account')}
    assert balances == {f'funding:{market.requester["id"]}': 0, f'escrow:{job["id"]}': 0}


def test_the_check_catches_a_missing_entry(app, market):
    job = market.job()
    app.service.db.execute('DELETE FROM ledger_entries WHERE id = (SELECT max(id) FROM ledger_entries)')
    problems = mp.ledger_problems(app.service.db)
    assert any('1 entries' in p for p in problems)
    assert any(f'job {job["id"]}' in p and 'escrowStatus does not match' in p for p in problems)
    restore(app)


def test_a_payout_that_reverted_counts_for_nothing_until_the_chain_shows_it_made(app, market):
    """CONTRACT 25: a failed payment's entries are reversed (the money stayed in escrow) and its job needs an admin;
    when the chain then shows the payment made by someone else's transaction, its pair of entries comes back."""
    db = app.service.db
    job, claim = market.delivered_job(paymentAmount='25.00')
    market.verify(job, claim, True)
    release = db.row("SELECT * FROM payments WHERE job_id = :id AND type = 'release'", job)
    with db.transaction():
        mp.fail_payments(db, job['id'], [release['id']], 'its release transaction 0xaa reverted on chain')
        mp.fail_payments(db, job['id'], [release['id']], 'again')           # failing twice reverses once
    assert (mp.escrow_balance(db, job['id']), len(entries(app, job))) == (25_000_000, 6)
    assert market.get_job(job)['job']['needsAdmin'] is True
    assert [(p['type'], p['status'], p['failure']) for p in market.get_job(job)['payments']] == [
        ('escrow', 'simulated', None), ('release', 'failed', 'its release transaction 0xaa reverted on chain')]
    assert mp.ledger_problems(db) == []         # a completed job needing an admin may hold what did not move
    event = {'name': 'Released', 'txHash': '0x' + 'bb' * 32, 'payee': release['recipient'].upper(),
             'amount': release['amount'], 'fee': 0, 'bySignature': True}
    with db.transaction():
        mp.record_foreign_payment(db, mp.get_job(db, job['id']), event)
    assert db.row('SELECT status, tx_hash, failure, origin FROM payments WHERE id = :id', release) == \
        {'status': 'confirmed', 'tx_hash': '0x' + 'bb' * 32, 'failure': None, 'origin': None}
    assert (mp.escrow_balance(db, job['id']), len(entries(app, job))) == (0, 8)
    assert mp.ledger_problems(db) == []
    # the same money shown as released once more is no record of ours: recorded as it was, and the books say so
    with db.transaction():
        mp.record_foreign_payment(db, mp.get_job(db, job['id']), dict(event, txHash='0x' + 'cc' * 32))
    assert db.row("SELECT type, origin, recipient FROM payments WHERE tx_hash = :tx", {'tx': '0x' + 'cc' * 32}) == \
        {'type': 'release', 'origin': 'chain', 'recipient': release['recipient'].upper()}
    assert any('escrow holds -25000000' in problem for problem in mp.ledger_problems(db))
    restore(app)


def test_the_check_catches_payments_whose_pairs_do_not_add_up(app, market):
    job = market.job()
    db = app.service.db
    escrow = db.row("SELECT id FROM payments WHERE job_id = :id", job)
    with db.transaction():          # a reversal of only one side: the pair is broken
        db.execute("""INSERT INTO ledger_entries (payment_id, job_id, account, amount, currency, created_at)
                      SELECT payment_id, job_id, account, -amount, currency, created_at FROM ledger_entries
                      WHERE payment_id = :id ORDER BY id LIMIT 1""", escrow)
    assert any(f'payment {escrow["id"]}: 3 entries' in problem for problem in mp.ledger_problems(db))
    with db.transaction():          # and the other side: four entries, but the payment is not cancelled
        db.execute("""INSERT INTO ledger_entries (payment_id, job_id, account, amount, currency, created_at)
                      SELECT payment_id, job_id, account, -amount, currency, created_at FROM ledger_entries
                      WHERE payment_id = :id ORDER BY id LIMIT 1 OFFSET 1""", escrow)
    assert any(f'payment {escrow["id"]}: 4 entries, net 0' in problem for problem in mp.ledger_problems(db))
    restore(app)


def test_the_check_catches_money_left_in_a_final_job(app, market):
    job = market.job()
    app.service.db.execute("UPDATE jobs SET status = 'cancelled' WHERE id = :id", {'id': job['id']})
    assert mp.ledger_problems(app.service.db) == [
        f'job {job["id"]} (cancelled, escrow locked): final but escrow still holds 25000000']
    restore(app)


def test_the_check_catches_an_unrecorded_payout(app, market):
    job = market.job()
    db = app.service.db
    db.execute("UPDATE payments SET amount = 24000000 WHERE type = 'escrow'")
    problems = mp.ledger_problems(db)
    assert len(problems) == 2
    assert 'net' in problems[0] or 'entries' in problems[0]
    assert f'job {job["id"]}' in problems[1] and 'locked 24000000' in problems[1]
    restore(app)


def test_the_check_catches_a_negative_worker_account(app, market):
    job, claim = market.delivered_job()
    market.verify(job, claim, True)
    db = app.service.db
    db.execute("UPDATE ledger_entries SET amount = -amount WHERE account LIKE 'worker:%'")
    assert any(p.startswith(f'account worker:{market.agent["id"]} holds -25000000') for p in mp.ledger_problems(db))
    restore(app)


def restore(app):
    """Leave a database the teardown's ledger check accepts (the corruption was the point)."""
    db = app.service.db
    for table in ('ledger_entries', 'payments', 'reputation_events', 'claims', 'webhook_events', 'jobs'):
        db.execute(f'DELETE FROM {table}')


def test_format_and_units():
    assert mp.format_cents(2550) == '25.50'
    assert mp.format_cents(5) == '0.05'
    assert mp.format_cents(-25) == '-0.25'
    assert mp.cents_to_units(2550, 'USDC') == 25_500_000
    assert mp.cents_to_units(2550, 'USD') == 2550
    assert mp.format_units(25_509_999, 'USDC') == '25.50'
    assert mp.read_money('25') == 2500 and mp.read_money('25.5') == 2550
    for number in (7, 7.0, True):
        with pytest.raises(ValueError, match='a JSON string, not a number'):
            mp.read_money(number)
