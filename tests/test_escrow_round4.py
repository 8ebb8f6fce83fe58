"""The fourth attack on contract mode (CONTRACT.md 25), each way that worked tried again against the real server, a
real local EVM (anvil) with TestUSDC and the new JobEscrow: a requester paying itself back after delivery (refused by
the contract), a worker sending its releaseAuthorization itself while the service is stopped, payments sent by
somebody else (an execution of our proposal, a refund with the arbiter's key used elsewhere) reconciled from the
contract's events, a proposal that reverted leaving nothing scheduled, and one relayed deposit per payer in flight.
Only 127.0.0.1; every test uses the `escrow` fixture, so the chain is put back as it was after it."""

import threading

from chain import Account, ContractLogicError, Web3
from conftest import ADMIN_KEY, job_body
from test_escrow_api import (FEE, PAID, PRICE, authorization, contract_calls, delivery, deposit, detail, funded,
                             post_job, proposal_time, requirements, serving, verify)
from test_escrow_contract import ARBITER, FEES, GUARDIAN, RELAYER, escrow  # noqa: F401 (escrow: a fixture)
from test_onchain import (assert_refused, call, ledger_of, new_requester, new_worker, nonce_of, one, proxy,  # noqa: F401
                          settle, statuses)
from test_server import claim_and_deliver

import marketplace as mp

N = 0xfffffffffffffffffffffffffffffffebaaedce6af48a03bbfd25e8cd0364141     # secp256k1's order


def hexbytes(value):
    return bytes.fromhex(value[2:])


def db_value(path, sql):
    db = mp.Database(str(path))
    try:
        return db.value(sql)
    finally:
        db.close()


def gauge(server, name):
    for line in call(server, 'GET', '/metrics', key=ADMIN_KEY).text.splitlines():
        if line.startswith(name + ' '):
            return float(line.split()[1])
    raise AssertionError(f'{name} is not on /metrics')


def test_a_requester_cannot_pay_itself_back_after_the_work_is_delivered(anvil, escrow, tmp_path):
    with serving(tmp_path / 'm.db', anvil.url, escrow.address, '--sweep-interval', '0.3') as server:
        key = new_requester(server)
        job, payer, made = funded(server, escrow, anvil, key)
        claim_id, wallet = delivery(server, job)
        release = detail(server, job, key)['releaseTypedData'][claim_id]
        claim = hexbytes(release['message']['claim'])
        # The round-4 attack: a Release of the whole deposit to the payer's own wallet, sent by the payer itself
        # before refundAfter, with its own signature in the arbiter's place (or none).
        own = dict(release, message=dict(release['message'], payee=payer.address, amount=str(PRICE), fee='0'))
        signed = hexbytes(contract_calls.sign_typed_data(payer.key, own))
        for arbiter_signature in (signed, b''):
            escrow.refused('release', hexbytes(made), claim, payer.address, PRICE, 0, signed, arbiter_signature,
                           key=payer.key, reason="not the arbiter's signature")
        # A malleated (high-s) signature of the right Release would be refused by the contract: the API refuses it
        # first, so no approval stands on a release that cannot pay.
        good = hexbytes(contract_calls.sign_typed_data(payer.key, release))
        high = good[:32] + (N - int.from_bytes(good[32:64], 'big')).to_bytes(32, 'big') + bytes([55 - good[64]])
        assert_refused(verify(server, key, job, claim_id, True, releaseSignature='0x' + high.hex()), 402,
                       'payment_signature_invalid')
        answer = verify(server, key, job, claim_id, True, releaseSignature='0x' + good.hex())
        assert answer.status_code == 200, answer.text
        authorization_shown = one_claim(answer.json())['releaseAuthorization']
        # What the server co-signed, the payer cannot turn to itself: the payee is in what both signed.
        escrow.refused('release', hexbytes(made), claim, payer.address, PAID, FEE,
                       hexbytes(authorization_shown['payerSignature']), hexbytes(authorization_shown['arbiterSignature']),
                       key=payer.key, reason="not the payer's signature")
        settle(anvil, lambda: statuses(server, job['id']) == {'escrow': 'confirmed', 'release': 'confirmed',
                                                              'fee': 'confirmed'})
        assert (anvil.balance(wallet), anvil.balance(payer.address), anvil.balance(FEES.address),
                anvil.balance(escrow.address)) == (PAID, 0, FEE, 0)
        assert detail(server, job)['job']['needsAdmin'] is False
    assert ledger_of(tmp_path / 'm.db') == []


def one_claim(answer):
    return answer['claim'] if 'claim' in answer else answer['claims'][0]


def test_a_worker_sends_its_release_authorization_itself_while_the_service_is_stopped(anvil, escrow, proxy, tmp_path):
    db = tmp_path / 'm.db'
    with serving(db, proxy.url, escrow.address, '--sweep-interval', '600') as server:
        key, stranger = new_requester(server), new_requester(server, 'stranger')
        job, payer, made = funded(server, escrow, anvil, key)
        other, other_payer, _ = funded(server, escrow, anvil, key)
        agent, worker_key, wallet = new_worker(server)
        claim_id = claim_and_deliver(server, job, agent['id'], worker_key)
        release = detail(server, job, key)['releaseTypedData'][claim_id]
        nonce = nonce_of(anvil, ARBITER.address)
        proxy.holding = True
        answer = verify(server, key, job, claim_id, True,
                        releaseSignature=contract_calls.sign_typed_data(payer.key, release))
        assert answer.status_code == 200, answer.text
        # Neither the release nor its fee is confirmed before a transaction paying them is mined.
        assert {p['type']: p['status'] for p in answer.json()['payments']} == {'release': 'pending', 'fee': 'pending'}
        held = proxy.wait_for_held()        # committed; its broadcast never reaches the chain
        shown = detail(server, job, worker_key)['claims'][0]['releaseAuthorization']
        assert {name: shown[name] for name in ('contract', 'chainId', 'id', 'claim', 'payee', 'amount', 'fee')} == {
            'contract': escrow.address, 'chainId': 8453, 'id': made, 'claim': Web3.keccak(text=claim_id).to_0x_hex(),
            'payee': wallet, 'amount': str(PAID), 'fee': str(FEE)}
        assert contract_calls.typed_data_signer(release, shown['arbiterSignature']) == ARBITER.address
        assert detail(server, job, stranger)['claims'][0]['releaseAuthorization'] is None
        assert detail(server, job)['claims'][0]['releaseAuthorization'] is None
        server.kill()
    proxy.holding = False
    held['release'].set()
    assert anvil.balance(wallet) == 0
    # The service is down: the worker (or anyone for it) sends the co-signed release.
    sent = escrow.call('release', hexbytes(shown['id']), hexbytes(shown['claim']), shown['payee'], int(shown['amount']),
                       int(shown['fee']), hexbytes(shown['payerSignature']), hexbytes(shown['arbiterSignature']),
                       key=RELAYER.key)
    assert (anvil.balance(wallet), anvil.balance(FEES.address)) == (PAID, FEE)
    anvil.mine(2)
    with serving(db, proxy.url, escrow.address, '--sweep-interval', '0.3') as server:
        settle(anvil, lambda: statuses(server, job['id']) == {'escrow': 'confirmed', 'release': 'confirmed',
                                                              'fee': 'confirmed'})
        paid = {p['type']: p['txHash'] for p in detail(server, job)['payments']}
        assert (paid['release'], paid['fee']) == (sent, sent)          # what the chain says paid them
        assert detail(server, job)['job']['needsAdmin'] is False
        # The service's own release was never needed: the nonce it held goes to the next call, which is mined.
        answer = call(server, 'POST', f'/api/jobs/{other["id"]}/cancel', None, key)
        assert answer.status_code == 200, answer.text
        settle(anvil, lambda: statuses(server, other['id']).get('refund') == 'confirmed')
        assert anvil.balance(other_payer.address) == PRICE
        assert nonce_of(anvil, ARBITER.address) in (nonce + 1, nonce + 2)  # the refund; the release if it was sent
        assert (anvil.balance(wallet), anvil.balance(escrow.address)) == (PAID, 0)
        assert gauge(server, 'marketplace_jobs_needing_admin') == 0
    assert ledger_of(db) == []


def wait_for_proposal(db, anvil, escrow, made):
    """The sweep proposed the deposit's payouts and saw its proposal confirmed."""
    settle(anvil, lambda: proposal_time(escrow, made) and db_value(
        db, "SELECT count(*) FROM escrow_calls WHERE function = 'propose' AND status = 'confirmed'"))


def test_an_execution_and_a_refund_sent_by_somebody_else_are_reconciled(anvil, escrow, tmp_path):
    db = tmp_path / 'm.db'
    with serving(db, anvil.url, escrow.address, '--sweep-interval', '0.3') as server:
        key = new_requester(server)
        job, payer, made = funded(server, escrow, anvil, key)
        robbed, robbed_payer, robbed_deposit = funded(server, escrow, anvil, key)
        claim_id, wallet = delivery(server, job)
        answer = verify(server, key, job, claim_id, True)
        assert answer.status_code == 200, answer.text
        wait_for_proposal(db, anvil, escrow, made)
        executable_at = proposal_time(escrow, made)
        assert server.terminate() == 0
    # While the service is stopped: a stranger executes our proposal once its delay has passed, and the arbiter's
    # key, used outside the service, refunds part of another deposit.
    anvil.set_next_timestamp(executable_at + 1)
    stranger = escrow.funded_payer(0)
    executed = escrow.call('execute', hexbytes(made), key=stranger.key)
    refunded = escrow.call('refund', hexbytes(robbed_deposit), 5_000_000, key=ARBITER.key)
    anvil.mine(2)
    with serving(db, anvil.url, escrow.address, '--sweep-interval', '0.3') as server:
        settle(anvil, lambda: statuses(server, job['id']).get('release') == 'confirmed'
               and detail(server, robbed)['job']['needsAdmin'])
        paid = {p['type']: (p['status'], p['txHash']) for p in detail(server, job)['payments']}
        assert paid == {'escrow': ('confirmed', None), 'release': ('confirmed', executed),
                        'fee': ('confirmed', executed)}
        assert anvil.balance(wallet) == PAID and detail(server, job)['job']['needsAdmin'] is False
        shown = detail(server, robbed)
        assert [(p['type'], p['amount'], p['status'], p['txHash'], p['recipient']) for p in shown['payments']] == [
            ('escrow', '25.00', 'confirmed', None, escrow.address),
            ('refund', '5.00', 'confirmed', refunded, robbed_payer.address)]
        assert shown['job']['needsAdmin'] is True
        assert gauge(server, 'marketplace_jobs_needing_admin') == 1
        # Once the rest goes back to the payer too, the chain and the ledger agree again.
        answer = call(server, 'POST', f'/api/jobs/{robbed["id"]}/cancel', None, key)
        assert answer.status_code == 200, answer.text
        settle(anvil, lambda: not detail(server, robbed)['job']['needsAdmin']
               and [p['status'] for p in detail(server, robbed)['payments']] == ['confirmed'] * 3)
        assert [(p['type'], p['amount'], p['status']) for p in detail(server, robbed)['payments']] == [
            ('escrow', '25.00', 'confirmed'), ('refund', '5.00', 'confirmed'), ('refund', '20.00', 'confirmed')]
        assert anvil.balance(robbed_payer.address) == PRICE
        assert gauge(server, 'marketplace_jobs_needing_admin') == 0
    assert ledger_of(db) == []


def test_a_proposal_that_reverts_leaves_nothing_scheduled_and_the_job_needing_an_admin(anvil, escrow, tmp_path):
    db = tmp_path / 'm.db'
    with serving(db, anvil.url, escrow.address, '--sweep-interval', '600') as server:
        key = new_requester(server)
        job, payer, made = funded(server, escrow, anvil, key)
        claim_id, wallet = delivery(server, job)
        answer = verify(server, key, job, claim_id, True)
        assert answer.status_code == 200, answer.text
        assert {p['type']: p['status'] for p in answer.json()['payments']} == \
            {'release': 'scheduled', 'fee': 'scheduled'}
        assert server.terminate() == 0
    # The arbiter's key used elsewhere makes a proposal first: the service's own proposal of the deposit reverts.
    escrow.call('propose', hexbytes(made), [ARBITER.address], [PRICE], 0, key=ARBITER.key)
    anvil.mine(2)
    with serving(db, anvil.url, escrow.address, '--sweep-interval', '0.3') as server:
        settle(anvil, lambda: statuses(server, job['id']).get('release') == 'failed', seconds=20)
        shown = detail(server, job)
        assert {p['type']: p['status'] for p in shown['payments']} == \
            {'escrow': 'confirmed', 'release': 'failed', 'fee': 'failed'}
        assert shown['job']['needsAdmin'] is True
        assert gauge(server, 'marketplace_jobs_needing_admin') == 1
        assert gauge(server, 'marketplace_escrow_proposals_pending{state="proposed"}') == 0
        # The guardian cancels the proposal it did not expect; nothing was paid to anyone.
        escrow.call('cancel', hexbytes(made), key=GUARDIAN.key)
        assert (anvil.balance(wallet), anvil.balance(ARBITER.address), anvil.balance(escrow.address)) == (0, 0, PRICE)
    assert db_value(db, "SELECT count(*) FROM payments WHERE status = 'scheduled'") == 0
    assert ledger_of(db) == []


def test_one_relayed_deposit_per_payer_is_in_flight(anvil, escrow, tmp_path):
    with serving(tmp_path / 'm.db', anvil.url, escrow.address, '--sweep-interval', '600') as server:
        key = new_requester(server)
        payer = Account.create()
        anvil.mint(payer.address, PRICE)        # one balance behind five signed authorizations
        bodies = [job_body(title=f'Job number {n}') for n in range(5)]
        signed = [authorization(escrow, payer, requirements(server, key, body)) for body in bodies]
        nonce = nonce_of(anvil, ARBITER.address)
        answers = [None] * 5
        start = threading.Barrier(5)

        def post(n):
            start.wait()
            answers[n] = post_job(server, key, bodies[n], escrowAuthorization=signed[n])
        threads = [threading.Thread(target=post, args=(n,)) for n in range(5)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        outcomes = sorted((answer.status_code, answer.json()['code']) for answer in answers)
        assert outcomes == [(402, 'payment_pending')] + [(409, 'payment_pending')] * 4
        assert nonce_of(anvil, ARBITER.address) == nonce + 1          # one relay sent, on the server's gas
        refused = next(answer for answer in answers if answer.status_code == 409).json()
        assert 'escrowRequirements' in refused and refused['depositId'].startswith('0x')
        # Another authorization of the same payer still waits while the first is not confirmed.
        again = authorization(escrow, payer, requirements(server, key, job_body(title='One more')))
        assert_refused(post_job(server, key, job_body(title='One more'), escrowAuthorization=again), 409,
                       'payment_pending')
        assert nonce_of(anvil, ARBITER.address) == nonce + 1
