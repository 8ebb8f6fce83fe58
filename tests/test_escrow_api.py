"""Contract mode end to end (CONTRACT.md 21 and 25, docs/payments-on-chain.md "The JobEscrow contract"): the real server as a process, a real
local EVM (anvil) with TestUSDC and a JobEscrow deployed, every job's USDC in the contract and the server's key (the
contract's arbiter) holding none of it, ever.

Each way of funding (the payer's own deposit, a relayed authorization), approval with the payer's Release signature
(paid at once) and without (proposed, paid once the chain's clock passes the delay), a guardian cancelling a
proposal with `marketplace.py escrow cancel`, rejection and expiry (refunded at once), a deposit reclaimed by a
stranger after its refundAfter, a SIGKILL between a refund's commit and its broadcast (sent once after the
restart), and a contract this server cannot run refused at start. Every test uses the `escrow` fixture, so the chain is put back as it was after it. Only 127.0.0.1.
"""

import secrets
import subprocess
import sys
import time
from datetime import datetime, timedelta, timezone

import pytest

from chain import DEV_KEYS, USDC, Account, Web3
from conftest import ADMIN_KEY, ROOT, LiveServer, job_body
from test_escrow_contract import ARBITER, DELAY, FEES, GUARDIAN, escrow  # noqa: F401 (escrow: a fixture)
from test_onchain import (ACCOUNT_OF_KEY, assert_refused, call, ledger_of, new_requester, new_worker,  # noqa: F401
                          nonce_of, one, proxy, running, settle, statuses)
from test_server import claim_and_deliver
from verifier import escrow as contract_calls

PRICE = 25_000_000          # 25.00 USDC
PAID, FEE = 24_500_000, 500_000     # --fee-percent 2


def serving(db, rpc_url, contract, *extra):
    """The server in contract mode: its key (DEV_KEYS[1]) is the contract's arbiter; 2 confirmations."""
    args = ['--rpc-url', rpc_url, '--chain-id', '8453', '--confirmations', '2', '--rate-limits', 'off',
            '--escrow-contract', contract, '--fee-percent', '2', *extra]
    return running(LiveServer(db, args, env={'MARKETPLACE_ESCROW_KEY': DEV_KEYS[1]}))


def post_job(server, key, body, **funding):
    return call(server, 'POST', '/api/jobs', dict(body, **funding), key)


def requirements(server, key, body):
    """The 402 of a job posted without funding: its escrowRequirements."""
    return assert_refused(post_job(server, key, body), 402, 'payment_required')['escrowRequirements']


def deposit(escrow, wanted, refund_after=None, amount=None):
    """A payer (with ETH) deposits for `wanted` (escrowRequirements) itself: (payer, deposit id)."""
    amount = amount or int(wanted['amount'])
    payer = escrow.funded_payer(amount)
    made = escrow.deposit(payer, amount, bytes.fromhex(wanted['account'][2:]), refund_after or wanted['minRefundAfter'])
    return payer, '0x' + made.hex()


def authorization(escrow, payer, wanted, signer=None):
    """escrowAuthorization: `payer`'s ReceiveWithAuthorization (signed by `signer`, the payer by default)."""
    salt = secrets.token_bytes(32)
    account, refund_after = bytes.fromhex(wanted['account'][2:]), wanted['minRefundAfter']
    nonce = escrow.contract.functions.depositId(payer.address, account, refund_after, salt).call()
    valid_after, valid_before, signature = escrow.authorization(signer or payer, int(wanted['amount']), account,
                                                                refund_after, salt, nonce=nonce)
    return {'payer': payer.address, 'refundAfter': refund_after, 'salt': '0x' + salt.hex(),
            'validAfter': valid_after, 'validBefore': valid_before, 'signature': '0x' + signature.hex()}


def funded(server, escrow, anvil, key):
    """A job funded by its payer's own deposit, open: (job, payer, deposit id)."""
    body = job_body()
    payer, made = deposit(escrow, requirements(server, key, body))
    anvil.mine(1)
    answer = post_job(server, key, body, escrowDepositId=made)
    assert answer.status_code == 201, answer.text
    assert answer.json()['job']['escrowDepositId'] == made      # what its payer reclaims, if it comes to that
    return answer.json()['job'], payer, made


def delivery(server, job):
    """A new worker claims and delivers the job: (claim id, the worker's wallet)."""
    agent, worker_key, wallet = new_worker(server)
    return claim_and_deliver(server, job, agent['id'], worker_key), wallet


def verify(server, key, job, claim_id, approved, **extra):
    return call(server, 'POST', f'/api/jobs/{job["id"]}/verify', dict(claimId=claim_id, approved=approved, **extra),
                key)


def detail(server, job, key=None):
    answer = call(server, 'GET', f'/api/jobs/{job["id"]}', key=key)
    assert answer.status_code == 200, answer.text
    return answer.json()


def cli(db, rpc_url, contract, *args):
    return subprocess.run([sys.executable, str(ROOT / 'marketplace.py'), 'escrow', *args, '--db', str(db),
                           '--rpc-url', rpc_url, '--chain-id', '8453', '--escrow-contract', contract],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)


def test_a_job_funded_by_its_payers_deposit_and_what_a_stranger_cannot_do_with_it(anvil, escrow, tmp_path):
    with serving(tmp_path / 'm.db', anvil.url, escrow.address) as server:
        key, stranger = new_requester(server), new_requester(server, 'stranger')
        account = ACCOUNT_OF_KEY[key]
        body = job_body()
        wanted = requirements(server, key, body)
        deadline = int(datetime.fromisoformat(body['deadline'].replace('Z', '+00:00')).timestamp())
        assert {name: value for name, value in wanted.items() if name != 'authorizationTypedData'} == {
            'contract': escrow.address, 'token': USDC, 'chainId': 8453, 'amount': str(PRICE),
            'account': Web3.keccak(text=account).to_0x_hex(), 'arbiterDelay': DELAY,
            'minRefundAfter': deadline + 3600 * (24 + 168) + DELAY + 86400,
            'depositId': 'keccak256(abi.encode(payer, account, refundAfter, salt))'}
        typed = wanted['authorizationTypedData']
        assert (typed['primaryType'], typed['domain']['verifyingContract'], typed['message']['to'],
                typed['message']['value']) == ('ReceiveWithAuthorization', USDC, escrow.address, str(PRICE))

        payer, made = deposit(escrow, wanted)
        refused = assert_refused(post_job(server, key, body, escrowDepositId=made), 402, 'payment_pending')
        assert refused['escrowRequirements'] == dict(refused['escrowRequirements'], account=wanted['account'])
        anvil.mine(1)       # two deep now
        # A stranger who copies the deposit id: the deposit names another account.
        assert_refused(post_job(server, stranger, body, escrowDepositId=made), 402, 'payment_signature_invalid')
        answer = post_job(server, key, body, escrowDepositId=made)
        assert answer.status_code == 201, answer.text
        job = answer.json()['job']
        assert (job['status'], job['escrowStatus'], job['escrowTxHash']) == ('open', 'locked', None)
        again = post_job(server, key, body, escrowDepositId=made)        # a retry: the same job
        assert (again.status_code, again.json()['job']['id']) == (200, job['id'])
        other = assert_refused(post_job(server, key, job_body(title='Another job'), escrowDepositId=made), 409,
                               'payment_replayed')
        assert other['jobId'] == job['id']
        escrow_record = one(detail(server, job)['payments'], 'escrow')
        assert (escrow_record['status'], escrow_record['amount'], escrow_record['recipient']) == \
            ('confirmed', '25.00', escrow.address)

        # A deposit its payer could take back before the job can be decided: refused, and nothing is funded.
        _, early = deposit(escrow, wanted, refund_after=wanted['minRefundAfter'] - 1)
        _, small = deposit(escrow, wanted, amount=PRICE - 1)
        anvil.mine(1)
        assert_refused(post_job(server, key, body, escrowDepositId=early), 400, 'payment_invalid')
        assert_refused(post_job(server, key, body, escrowDepositId=small), 402, 'payment_insufficient')
        assert_refused(post_job(server, key, body, escrowDepositId='0x' + '11' * 32), 402, 'payment_pending')

        time.sleep(2.1)     # health asks the node at most every 2 s
        health = call(server, 'GET', '/api/health').json()
        assert health['escrow'] == {'mode': 'contract', 'contract': escrow.address, 'arbiter': ARBITER.address,
                                    'guardian': GUARDIAN.address, 'arbiterDelay': DELAY}
        assert (anvil.balance(escrow.address), anvil.balance(ARBITER.address)) == (3 * PRICE - 1, 0)


def test_a_relayed_deposit_and_an_approval_signed_by_the_payer_pay_at_once(anvil, escrow, tmp_path):
    db = tmp_path / 'm.db'
    with serving(db, anvil.url, escrow.address, '--sweep-interval', '0.3') as server:
        key = new_requester(server)
        body = job_body()
        wanted = requirements(server, key, body)
        payer = Account.create()
        anvil.mint(payer.address, PRICE)            # USDC, and no ETH at all
        nonce = nonce_of(anvil, ARBITER.address)
        forged = authorization(escrow, payer, wanted, signer=Account.create())
        assert_refused(post_job(server, key, body, escrowAuthorization=forged), 402, 'payment_signature_invalid')
        assert nonce_of(anvil, ARBITER.address) == nonce        # simulated, refused, never sent
        signed = authorization(escrow, payer, wanted)
        # The service makes the deposit (and pays its gas); one block is not yet two deep.
        assert_refused(post_job(server, key, body, escrowAuthorization=signed), 402, 'payment_pending')
        anvil.mine(1)
        answer = post_job(server, key, body, escrowAuthorization=signed)
        assert answer.status_code == 201, answer.text
        job = answer.json()['job']
        assert nonce_of(anvil, ARBITER.address) == nonce + 1        # relayed once, though posted twice
        assert (anvil.balance(escrow.address), anvil.balance(payer.address), anvil.w3.eth.get_balance(payer.address)) \
            == (PRICE, 0, 0)

        claim_id, wallet = delivery(server, job)
        release = detail(server, job, key)['releaseTypedData'][claim_id]
        made = '0x' + contract_calls.deposit_id(payer.address, wanted['account'], signed['refundAfter'],
                                                signed['salt'])[2:]
        assert release['message'] == {'id': made, 'claim': Web3.keccak(text=claim_id).to_0x_hex(), 'payee': wallet,
                                      'amount': str(PAID), 'fee': str(FEE)}
        assert release['domain'] == {'name': 'JobEscrow', 'version': '2', 'chainId': 8453,
                                     'verifyingContract': escrow.address}
        assert 'releaseTypedData' not in detail(server, job) and 'releaseTypedData' not in \
            detail(server, job, new_requester(server, 'stranger'))
        # Signed by anyone but the payer (a stranger, the worker's side): refused, and the claim waits.
        stranger = contract_calls.sign_typed_data(Account.create().key, release)
        assert_refused(verify(server, key, job, claim_id, True, releaseSignature=stranger), 402,
                       'payment_signature_invalid')
        assert detail(server, job)['claims'][0]['status'] == 'delivered'
        answer = verify(server, key, job, claim_id, True,
                        releaseSignature=contract_calls.sign_typed_data(payer.key, release))
        assert answer.status_code == 200, answer.text
        paid = one(answer.json()['payments'], 'release')
        assert (paid['status'], paid['amount'], paid['recipient']) == ('pending', '24.50', wallet)
        settle(anvil, lambda: statuses(server, job['id'])['release'] == 'confirmed')
        assert statuses(server, job['id'])['fee'] == 'confirmed'
        assert (anvil.balance(wallet), anvil.balance(FEES.address), anvil.balance(escrow.address),
                anvil.balance(ARBITER.address)) == (PAID, FEE, 0, 0)
        assert server.terminate() == 0
    assert ledger_of(db) == []


def test_approvals_without_a_signature_wait_out_the_delay_and_the_guardian_cancels_one(anvil, escrow, tmp_path):
    db = tmp_path / 'm.db'
    with serving(db, anvil.url, escrow.address, '--sweep-interval', '0.3') as server:
        key = new_requester(server)
        first, _, first_deposit = funded(server, escrow, anvil, key)
        second, second_payer, second_deposit = funded(server, escrow, anvil, key)
        claims = [delivery(server, job) for job in (first, second)]
        for job, (claim_id, wallet) in zip((first, second), claims):
            answer = verify(server, key, job, claim_id, True)
            assert answer.status_code == 200, answer.text
            scheduled = one(answer.json()['payments'], 'release')
            assert (scheduled['status'], scheduled['txHash'], scheduled['executableAt']) == ('scheduled', None, None)
        # The sweep proposes each; the proposal waits out the delay on chain.
        settle(anvil, lambda: all(one(detail(server, job)['payments'], 'release')['executableAt']
                                  for job in (first, second)))
        settle(anvil, lambda: all(proposal_time(escrow, made) for made in (first_deposit, second_deposit)))
        listed = cli(db, anvil.url, escrow.address, 'proposals')
        assert listed.returncode == 0, listed.stderr
        assert f'{second_deposit}  job {second["id"]}' in listed.stdout
        assert f'pays 24.50 USDC to {claims[1][1]}' in listed.stdout and '2 pending proposal(s)' in listed.stdout
        gauges = call(server, 'GET', '/metrics', key=ADMIN_KEY).text
        assert 'marketplace_escrow_proposals_pending{state="proposed"} 2.0' in gauges

        # The guardian cancels the second, with its key from a file; the wrong key is refused before sending.
        wrong = tmp_path / 'wrong.key'
        wrong.write_text(DEV_KEYS[1])
        refused = cli(db, anvil.url, escrow.address, 'cancel', second['id'], '--guardian-key-file', str(wrong))
        assert refused.returncode == 1 and 'not the contract\'s guardian' in refused.stderr
        key_file = tmp_path / 'guardian.key'
        key_file.write_text(GUARDIAN.key.hex())
        done = cli(db, anvil.url, escrow.address, 'cancel', second['id'], '--guardian-key-file', str(key_file))
        assert done.returncode == 0, done.stderr
        settle(anvil, lambda: statuses(server, second['id']).get('refund') == 'confirmed')
        assert one(detail(server, second)['payments'], 'release')['status'] == 'cancelled'
        assert anvil.balance(second_payer.address) == PRICE and anvil.balance(claims[1][1]) == 0

        # Nothing is paid before the delay has passed on chain; then the sweep executes the first.
        anvil.mine(2)
        time.sleep(1)
        assert anvil.balance(claims[0][1]) == 0
        anvil.set_next_timestamp(anvil.timestamp() + DELAY)
        settle(anvil, lambda: statuses(server, first['id'])['release'] == 'confirmed')
        assert (anvil.balance(claims[0][1]), anvil.balance(FEES.address), anvil.balance(escrow.address),
                anvil.balance(ARBITER.address)) == (PAID, FEE, 0, 0)
        assert statuses(server, first['id'])['fee'] == 'confirmed'
        assert one(detail(server, first)['payments'], 'fee')['recipient'] == FEES.address    # whom the contract paid
        gauges = call(server, 'GET', '/metrics', key=ADMIN_KEY).text
        assert 'marketplace_escrow_proposals_pending{state="proposed"} 0.0' in gauges
    assert ledger_of(db) == []


def proposal_time(escrow, made):
    """The executableAt of a deposit's pending proposal (0: none)."""
    return escrow.contract.functions.proposals(bytes.fromhex(made[2:])).call()[3]


def test_rejection_and_expiry_refund_at_once_and_a_reclaimed_deposit_ends_its_job(anvil, escrow, tmp_path):
    db = tmp_path / 'm.db'
    with serving(db, anvil.url, escrow.address, '--sweep-interval', '0.3') as server:
        key = new_requester(server)
        rejected, rejected_payer, _ = funded(server, escrow, anvil, key)
        claim_id, _ = delivery(server, rejected)
        answer = verify(server, key, rejected, claim_id, False)
        assert answer.status_code == 200, answer.text
        assert one(answer.json()['payments'], 'refund')['status'] == 'pending'

        soon = (datetime.now(timezone.utc) + timedelta(seconds=6)).isoformat()
        body = job_body(deadline=soon)
        expiring_payer, made = deposit(escrow, requirements(server, key, body))
        anvil.mine(1)
        expiring = post_job(server, key, body, escrowDepositId=made)
        assert expiring.status_code == 201, expiring.text
        expiring = expiring.json()['job']

        left, left_payer, left_deposit = funded(server, escrow, anvil, key)
        settle(anvil, lambda: statuses(server, rejected['id']).get('refund') == 'confirmed'
               and statuses(server, expiring['id']).get('refund') == 'confirmed', seconds=20)
        assert anvil.balance(rejected_payer.address) == PRICE and anvil.balance(expiring_payer.address) == PRICE
        assert detail(server, expiring)['job']['status'] == 'expired'

        # Past refundAfter anyone may send the deposit back to its payer; the job ends at the next sweep.
        refund_after = escrow.contract.functions.deposits(bytes.fromhex(left_deposit[2:])).call()[3]
        stranger = Account.create()
        anvil.set_eth(stranger.address, 10 ** 18)
        anvil.set_next_timestamp(refund_after)
        anvil.send(escrow.contract.functions.reclaim(bytes.fromhex(left_deposit[2:])), stranger.key, gas=200_000)
        settle(anvil, lambda: statuses(server, left['id']).get('reclaim') == 'confirmed')
        shown = detail(server, left)
        assert (shown['job']['status'], shown['job']['escrowStatus']) == ('expired', 'refunded')
        assert 'Reclaimed from the contract by the payer — 25.00 USDC (confirmed)' in \
            [entry['text'] for entry in shown['timeline'] if entry['kind'] == 'reclaim']
        assert (anvil.balance(left_payer.address), anvil.balance(escrow.address), anvil.balance(ARBITER.address)) == \
            (PRICE, 0, 0)
    assert ledger_of(db) == []


def test_a_crash_between_a_refund_and_its_broadcast_refunds_exactly_once(anvil, escrow, proxy, tmp_path):
    db = tmp_path / 'm.db'
    with serving(db, proxy.url, escrow.address, '--sweep-interval', '600') as server:
        key = new_requester(server)
        job, payer, _ = funded(server, escrow, anvil, key)
        nonce = nonce_of(anvil, ARBITER.address)
        proxy.holding = True
        answer = call(server, 'POST', f'/api/jobs/{job["id"]}/cancel', None, key)
        assert answer.status_code == 200, answer.text
        held = proxy.wait_for_held()        # committed, and the refund's broadcast is in flight
        server.kill()
    proxy.holding = False
    held['release'].set()
    assert anvil.balance(payer.address) == 0 and proxy.sent == []
    with serving(db, proxy.url, escrow.address, '--sweep-interval', '0.3') as server:
        settle(anvil, lambda: statuses(server, job['id']).get('refund') == 'confirmed')
        anvil.mine(3)
        time.sleep(1.0)                     # three sweeps more
        assert (anvil.balance(payer.address), anvil.balance(escrow.address)) == (PRICE, 0)
        assert nonce_of(anvil, ARBITER.address) == nonce + 1
        assert {raw for raw, _ in proxy.sent} == {held['raw']}      # the same signed call, sent again
    assert ledger_of(db) == []


def test_a_contract_this_server_cannot_run_is_refused_at_start(anvil, escrow, tmp_path):
    stranger_key = DEV_KEYS[2]          # not the contract's arbiter
    server = LiveServer(tmp_path / 'm.db', ['--rpc-url', anvil.url, '--chain-id', '8453', '--escrow-contract',
                                            escrow.address, '--fee-percent', '6'],
                        env={'MARKETPLACE_ESCROW_KEY': stranger_key})
    with pytest.raises(RuntimeError) as refused:
        server.start()
    said = str(refused.value)
    assert f'its arbiter is {ARBITER.address}, not {Account.from_key(stranger_key).address}' in said
    assert 'its fee cap is 500 basis points, below --fee-percent 6: refusing to start' in said
