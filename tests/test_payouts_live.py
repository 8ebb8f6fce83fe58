"""Stuck payouts on a real local EVM (anvil) and secrets out of a real server's output (CONTRACT.md 19): a payout
signed with a fee cap below the base fee is re-priced with its nonce and mined once, the one decided after it is
not stalled, a SIGKILL between re-signing and sending loses nothing; a server whose RPC URL carries a key never
shows it (nor the escrow, admin or API keys) in its output or its answers."""

import json
import sqlite3
import time

import pytest
import requests

from chain import Account, sign_funding
from conftest import ADMIN_KEY, LiveServer, free_port, job_body
from test_onchain import (ESCROW, PRICE, RPCProxy, funded_delivery, get_job, ledger_of, nonce_of, one, serving,
                          verify)

GWEI = 10 ** 9
HIGH_BASE_FEE = 10 * GWEI       # far above what the service learnt at start (anvil's ~1 gwei or less)


def raise_base_fee(anvil):
    """The next block's base fee jumps to HIGH_BASE_FEE; one block is mined with it."""
    anvil.rpc('anvil_setNextBlockBaseFeePerGas', hex(HIGH_BASE_FEE))
    anvil.mine(1)


def mine_high(anvil, done, seconds=20):
    """Mine a block at a time with the base fee kept high (an empty block would lower it) until done()."""
    deadline = time.monotonic() + seconds
    while not done():
        assert time.monotonic() < deadline, f'not settled in {seconds} s'
        anvil.rpc('anvil_setNextBlockBaseFeePerGas', hex(HIGH_BASE_FEE))
        anvil.mine(1)
        time.sleep(0.2)


@pytest.fixture
def base_fee_restored(anvil):
    """After the test (and after `usdc` put the chain back), the next block's base fee is an ordinary one again:
    anvil keeps an override of it across evm_revert."""
    yield
    anvil.rpc('anvil_setNextBlockBaseFeePerGas', hex(GWEI // 10))


def signed_rows(db_path, payment_id):
    with sqlite3.connect(db_path) as db:
        return [row[0] for row in db.execute('SELECT tx_hash FROM signed_transactions WHERE payment_id = ? '
                                             'ORDER BY seq', (payment_id,))]


def test_a_payout_below_the_base_fee_is_repriced_mined_once_and_the_next_is_not_stalled(anvil, base_fee_restored, usdc,
                                                                                        tmp_path):
    db = tmp_path / 'm.db'
    with serving(db, anvil.url, '--sweep-interval', '0.3', '--payout-rebroadcast-minutes', '0.02') as server:
        first_key, first_job, first_claim, first_wallet = funded_delivery(server, anvil)
        second_key, second_job, second_claim, second_wallet = funded_delivery(server, anvil)
        nonce_before = nonce_of(anvil, ESCROW)
        raise_base_fee(anvil)          # the service signs with the fees it learnt before: below the base fee
        first = one(verify(server, first_job, first_claim, True, first_key)['payments'], 'release')
        second = one(verify(server, second_job, second_claim, True, second_key)['payments'], 'release')

        def both_confirmed():
            return [one(get_job(server, job['id'])['payments'], 'release')['status']
                    for job in (first_job, second_job)] == ['confirmed', 'confirmed']
        mine_high(anvil, both_confirmed)
        anvil.mine(3)
        time.sleep(1.0)                # a few sweeps more: nothing is sent again
        assert anvil.balance(first_wallet) == PRICE
        assert anvil.balance(second_wallet) == PRICE
        assert nonce_of(anvil, ESCROW) == nonce_before + 2
        hashes = signed_rows(db, first['id'])
        assert hashes[0] == first['txHash'] and len(hashes) >= 2       # re-priced, never a new payment
        shown = one(get_job(server, first_job['id'])['payments'], 'release')
        assert shown['txHash'] == hashes[-1] != first['txHash']
        mined = anvil.w3.eth.get_transaction(shown['txHash'])
        assert mined['nonce'] == nonce_before and mined['maxFeePerGas'] >= HIGH_BASE_FEE
        assert anvil.w3.eth.get_transaction(one(get_job(server, second_job['id'])['payments'],
                                                'release')['txHash'])['nonce'] == nonce_before + 1
        assert server.terminate() == 0
    assert ledger_of(db) == []


class HoldingAfterFirstSend:
    """Truthy once the proxy has forwarded one eth_sendRawTransaction: the next one (the replacement) is held."""

    def __init__(self, proxy):
        self.proxy = proxy

    def __bool__(self):
        return len(self.proxy.sent) >= 1


def test_a_sigkill_between_resigning_and_sending_sends_the_stored_replacement_on_restart(anvil, base_fee_restored,
                                                                                         usdc, tmp_path):
    db = tmp_path / 'm.db'
    proxy = RPCProxy(anvil.url)
    try:
        with serving(db, proxy.url, '--sweep-interval', '0.3', '--payout-rebroadcast-minutes', '0.02') as server:
            key, job, claim_id, wallet = funded_delivery(server, anvil)
            nonce_before = nonce_of(anvil, ESCROW)
            raise_base_fee(anvil)
            proxy.holding = HoldingAfterFirstSend(proxy)
            release = one(verify(server, job, claim_id, True, key)['payments'], 'release')
            held = proxy.wait_for_held(15)       # the replacement: stored, and its broadcast in flight
            with sqlite3.connect(db) as conn:
                raw_tx, tx_hash = conn.execute('SELECT raw_tx, tx_hash FROM payments WHERE id = ?',
                                               (release['id'],)).fetchone()
            assert raw_tx == held['raw'] and tx_hash != release['txHash']
            server.kill()
        proxy.holding = False
        held['release'].set()
        assert anvil.balance(wallet) == 0

        with serving(db, proxy.url, '--sweep-interval', '0.3') as server:
            mine_high(anvil, lambda: one(get_job(server, job['id'])['payments'], 'release')['status'] == 'confirmed')
            assert held['raw'] in [raw for raw, _ in proxy.sent]            # the stored replacement went out
            shown = one(get_job(server, job['id'])['payments'], 'release')
            assert shown['txHash'] == tx_hash
            assert anvil.balance(wallet) == PRICE
            assert nonce_of(anvil, ESCROW) == nonce_before + 1
            assert server.terminate() == 0
        assert ledger_of(db) == []
    finally:
        proxy.close()


def test_no_secret_reaches_the_output_or_an_answer(tmp_path):
    rpc_url = f'http://127.0.0.1:{free_port()}/v2/SECRETKEY123?apikey=SECRET456'
    escrow_key = Account.create().key.hex()
    server = LiveServer(tmp_path / 'm.db', ['--rpc-url', rpc_url, '--facilitator-url',
                                            f'http://127.0.0.1:{free_port()}/fac/FACSECRET789'],
                        env={'MARKETPLACE_ESCROW_KEY': escrow_key})
    server.start()
    try:
        answers = [requests.get(server.url + '/api/health', timeout=20)]
        account = requests.post(server.url + '/api/accounts', json={'name': 'requester'}, timeout=20)
        api_key, account_id = account.json()['apiKey'], account.json()['account']['id']
        tx_hash = '0x' + '11' * 32
        signature = sign_funding(Account.create().key, account_id, tx_hash, Account.from_key(escrow_key).address)
        answers.append(requests.post(server.url + '/api/jobs', json=job_body(escrowTxHash=tx_hash, escrowSignature=signature),
                                     headers={'Authorization': f'Bearer {api_key}'}, timeout=30))
        answers.append(requests.get(server.url + '/api/jobs', timeout=20,
                                    headers={'Authorization': f'Bearer {ADMIN_KEY}'}))
        time.sleep(2.5)                 # health asks the node again after 2 s
        answers.append(requests.get(server.url + '/api/health', timeout=20))
        server.terminate()
        output = server.output()
    finally:
        if server.process.poll() is None:
            server.kill()
    assert answers[0].json()['chain']['reachable'] is False
    assert answers[1].status_code == 503 and answers[1].json()['code'] == 'chain_unavailable'
    assert 'node call' in output and 'http://127.0.0.1:' in output      # it did log the failures, by host only
    texts = [output] + [answer.text for answer in answers]
    for secret in ('SECRETKEY123', 'SECRET456', 'FACSECRET789', escrow_key, escrow_key.removeprefix('0x'),
                   ADMIN_KEY, api_key):
        assert not any(secret in text for text in texts), secret
    assert json.loads(answers[1].text)['status'] == 503
