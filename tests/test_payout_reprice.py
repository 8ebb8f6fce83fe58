"""Stuck payouts re-priced with the same nonce (CONTRACT.md 19, docs/payments-on-chain.md "USDC on Base: onchain mode"), in-process
against the fake JSON-RPC node of test_verifier: a payout unmined past --payout-rebroadcast-minutes, or refused
for its fee, is re-signed with a higher fee and stored before it is sent; whichever of its hashes is mined pays,
once. And secrets out of logs: redact_url and the log filter."""

import json
import logging
import sys

import pytest
import requests
from hexbytes import HexBytes

from chain import Account  # noqa: F401 (eth_account through chain.py first: the recursion limit)
from test_onchain_unit import (NODE_NONCE, app, by_type, db_of, funded_job, node, released, started,  # noqa: F401
                               stored, sweep)
from test_verifier import ESCROW, RPCFailure, decode, make_receipt

import marketplace as mp
from verifier.payouts import replacement_fees
from verifier.redact import SecretFilter, redact_url

GWEI = 10 ** 9


def fees_of(raw):
    tx = decode(raw)
    return tx['maxFeePerGas'], tx['maxPriorityFeePerGas']


def signed(market, payment_id):
    return [row['tx_hash'] for row in db_of(market).rows(
        'SELECT tx_hash FROM signed_transactions WHERE payment_id = :id ORDER BY seq', {'id': payment_id})]


def mine(node, tx_hash, block=101):
    node.add(make_receipt(block=block, tx_hash=tx_hash), frm=ESCROW)


def refuse_below_base_fee(node):
    """The node refuses a transaction whose max fee per gas is below its base fee, as geth and anvil do."""
    def send(params):
        node.sent.append(params[0])
        if fees_of(params[0])[0] < node.base_fee:
            raise RPCFailure('max fee per gas less than block base fee')
        return node.result('eth_sendRawTransaction_ok', params)
    node.answers['eth_sendRawTransaction'] = lambda params: answer(node, send, params)


def answer(node, send, params):
    try:
        body = {'jsonrpc': '2.0', 'id': 1, 'result': send(params)}
    except RPCFailure as failure:
        body = {'jsonrpc': '2.0', 'id': 1, 'error': {'code': failure.code, 'message': str(failure)}}
    return 200, {'Content-Type': 'application/json'}, json.dumps(body)


@pytest.fixture(autouse=True)
def node_hashes(node, monkeypatch):
    """eth_sendRawTransaction_ok: the FakeNode's own answer to a send it takes (the hash), for refuse_below_base_fee."""
    from eth_utils import keccak
    plain = node.result

    def result(method, params):
        if method == 'eth_sendRawTransaction_ok':
            return '0x' + keccak(HexBytes(params[0])).hex()
        return plain(method, params)
    monkeypatch.setattr(node, 'result', result)


# ----- the fees of a replacement -----

def test_a_replacement_pays_at_least_an_eighth_more_and_at_least_the_quote():
    assert replacement_fees((100, 10), (50, 5), 10 ** 6) == (113, 12)           # +12.5%, rounded up
    assert replacement_fees((100, 10), (400, 30), 10 ** 6) == (400, 30)         # the node asks more
    assert replacement_fees((100, 10), (400, 30), 300) == (300, 30)             # capped, still a replacement
    assert replacement_fees((100, 10), (50, 5), 112) is None                    # +12.5% would pass the ceiling


# ----- re-pricing by the sweep -----

def test_a_payout_unmined_past_the_rebroadcast_minutes_is_resigned_with_its_nonce_and_a_higher_fee(market, node):
    job, release = released(market, node)
    first = node.sent[0]
    mp.CLOCK.advance(minutes=9)
    # not yet: the same tx again
    assert sweep(market) == {'confirmed': 0, 'failed': 0, 'resent': 1, 'repriced': 0, 'renumbered': 0}
    assert node.sent[-1] == first
    node.base_fee = 3 * GWEI
    mp.CLOCK.advance(minutes=2)                                                         # 11 minutes after its broadcast
    assert sweep(market) == {'confirmed': 0, 'failed': 0, 'resent': 0, 'repriced': 1, 'renumbered': 0}
    replacement = node.sent[-1]
    old, new = decode(first), decode(replacement)
    assert new['nonce'] == old['nonce'] == NODE_NONCE
    assert (new['to'], new['data'], new['gas'], new['value']) == (old['to'], old['data'], old['gas'], old['value'])
    assert new['maxFeePerGas'] == 2 * 3 * GWEI + node.tip                               # the node's caps now
    assert new['maxPriorityFeePerGas'] == -(-old['maxPriorityFeePerGas'] * 9 // 8)     # +12.5% over the last tip
    row = db_of(market).row('SELECT * FROM payments WHERE id = :id', {'id': release['id']})
    assert row['raw_tx'] == replacement and row['nonce'] == NODE_NONCE and row['broadcast_at'] is not None
    assert signed(market, release['id']) == [release['txHash'], row['tx_hash']]
    assert by_type(market.get_job(job)['payments'], 'release')['txHash'] == row['tx_hash'] != release['txHash']
    assert db_of(market).value("SELECT count(*) FROM payments WHERE type = 'release'") == 1


def test_the_old_transaction_mined_after_the_resign_confirms_the_payment_with_its_own_hash(market, node):
    job, release = released(market, node)
    mp.CLOCK.advance(minutes=11)
    assert sweep(market)['repriced'] == 1
    new_hash = stored(market, signed(market, release['id'])[1])['tx_hash']
    mine(node, release['txHash'], block=101)                  # the first signature won the race
    node.latest = 102
    assert sweep(market) == {'confirmed': 1, 'failed': 0, 'resent': 0, 'repriced': 0, 'renumbered': 0}
    shown = by_type(market.get_job(job)['payments'], 'release')
    assert (shown['status'], shown['txHash']) == ('confirmed', release['txHash'])
    assert stored(market, new_hash) is None                   # the replacement never counts: same nonce
    assert signed(market, release['id']) == [release['txHash'], new_hash]
    assert sweep(market) == {'confirmed': 0, 'failed': 0, 'resent': 0, 'repriced': 0, 'renumbered': 0}
    assert mp.ledger_problems(db_of(market)) == []


def test_with_both_hashes_known_the_mined_replacement_is_the_one_payment(market, node):
    job, release = released(market, node)
    mp.CLOCK.advance(minutes=11)
    sweep(market)
    new_hash = signed(market, release['id'])[1]
    mine(node, new_hash, block=101)
    node.latest = 105
    assert sweep(market) == {'confirmed': 1, 'failed': 0, 'resent': 0, 'repriced': 0, 'renumbered': 0}
    payments = market.get_job(job)['payments']
    assert [(p['type'], p['status'], p['txHash']) for p in payments if p['type'] == 'release'] == \
        [('release', 'confirmed', new_hash)]



# ----- a nonce another transaction of the key used -----

def test_a_payout_whose_nonce_another_transaction_used_is_signed_again_with_the_next_unused_nonce(market, node):
    job, release = released(market, node)                   # signed with NODE_NONCE
    node.nonce = NODE_NONCE + 3                             # three transactions of the key, --confirmations deep
    mp.CLOCK.advance(minutes=11)
    assert sweep(market) == {'confirmed': 0, 'failed': 0, 'resent': 0, 'repriced': 0, 'renumbered': 1}
    first_raw = node.sent[0]
    old, new = decode(first_raw), decode(node.sent[-1])
    assert (old['nonce'], new['nonce']) == (NODE_NONCE, NODE_NONCE + 3)           # past the chain's, not just +1
    assert (new['to'], new['data'], new['gas'], new['value']) == (old['to'], old['data'], old['gas'], old['value'])
    row = db_of(market).row('SELECT * FROM payments WHERE id = :id', {'id': release['id']})
    assert (row['nonce'], row['raw_tx']) == (NODE_NONCE + 3, node.sent[-1]) and row['raw_tx'] != first_raw
    assert db_of(market).value("SELECT value FROM chain_state WHERE name = 'next_nonce'") == NODE_NONCE + 4
    mine(node, row['tx_hash'], block=101)
    node.latest = 102
    assert sweep(market) == {'confirmed': 1, 'failed': 0, 'resent': 0, 'repriced': 0, 'renumbered': 0}
    assert [(p['status'], p['txHash']) for p in market.get_job(job)['payments'] if p['type'] == 'release'] == \
        [('confirmed', row['tx_hash'])]
    assert mp.ledger_problems(db_of(market)) == []



def test_a_crash_between_renumbering_and_sending_leaves_the_new_transaction_stored_for_the_next_sweep(market, node):
    job, release = released(market, node)
    node.nonce = NODE_NONCE + 1
    mp.CLOCK.advance(minutes=11)
    onchain = market.client.app.service.settings.onchain
    payment = dict(stored(market, release['txHash']), tbl='payments')
    renumbered = onchain.reprice(db_of(market), payment, taken=node.nonce)     # stored; the process dies here
    row = db_of(market).row('SELECT * FROM payments WHERE id = :id', {'id': release['id']})
    assert (row['nonce'], row['tx_hash'], row['broadcast_at']) == (NODE_NONCE + 1, renumbered['tx_hash'], None)
    sent = len(node.sent)
    assert sweep(market) == {'confirmed': 0, 'failed': 0, 'resent': 0, 'repriced': 0, 'renumbered': 0}
    assert node.sent[sent:] == [renumbered['raw_tx']]        # the stored one, sent once, nothing signed again
    assert signed(market, release['id']) == [release['txHash'], renumbered['tx_hash']]

def test_a_payout_whose_own_transaction_used_its_nonce_is_never_signed_again(market, node):
    job, release = released(market, node)
    mine(node, release['txHash'], block=101)                # mined, not yet --confirmations deep
    node.nonce = NODE_NONCE + 1
    mp.CLOCK.advance(minutes=11)
    sent = len(node.sent)
    assert sweep(market) == {'confirmed': 0, 'failed': 0, 'resent': 0, 'repriced': 0, 'renumbered': 0}
    assert node.sent[sent:] == [] and signed(market, release['id']) == [release['txHash']]
    node.latest = 102
    assert sweep(market) == {'confirmed': 1, 'failed': 0, 'resent': 0, 'repriced': 0, 'renumbered': 0}


def test_a_nonce_used_but_not_yet_stale_is_not_renumbered(market, node):
    job, release = released(market, node)
    node.nonce = NODE_NONCE + 1
    mp.CLOCK.advance(minutes=9)             # a node that lags may not show the receipt yet: wait the rebroadcast minutes
    assert sweep(market) == {'confirmed': 0, 'failed': 0, 'resent': 1, 'repriced': 0, 'renumbered': 0}
    assert signed(market, release['id']) == [release['txHash']]


# ----- re-pricing on refusal, and the queue moves -----

def test_a_payout_refused_for_its_fee_is_repriced_at_once_and_later_payouts_are_not_stalled(market, node):
    refuse_below_base_fee(node)
    node.base_fee = 10                                       # what the service learnt at start: tiny fees
    job = funded_job(market, node)
    node.base_fee = 2 * GWEI                                 # then the base fee jumps
    claim = market.deliver(job, market.claim(job))
    release = by_type(market.verify(job, claim, True).json['payments'], 'release')
    assert fees_of(node.sent[0])[0] < node.base_fee          # refused for its fee...
    assert len(node.sent) == 2                               # ...and re-signed and sent at once
    assert decode(node.sent[1])['nonce'] == NODE_NONCE and fees_of(node.sent[1])[0] >= node.base_fee
    row = db_of(market).row('SELECT * FROM payments WHERE id = :id', {'id': release['id']})
    assert (row['raw_tx'], row['broadcast_at'] is not None) == (node.sent[1], True)
    second = funded_job(market, node)
    claim = market.deliver(second, market.claim(second))
    later = by_type(market.verify(second, claim, True).json['payments'], 'release')
    assert decode(node.sent[-1])['nonce'] == NODE_NONCE + 1  # the next nonce went out too
    mine(node, row['tx_hash'], block=101)
    mine(node, later['txHash'], block=102)
    node.latest = 103
    assert sweep(market) == {'confirmed': 2, 'failed': 0, 'resent': 0, 'repriced': 0, 'renumbered': 0}


def test_a_fee_past_the_ceiling_is_not_offered(started, node, caplog):
    from conftest import Client, Market
    market = Market(Client(started(payout_max_fee_gwei=0.001)))     # 1,000,000 wei per gas at most
    job, release = released(market, node)
    node.base_fee = 5 * GWEI
    mp.CLOCK.advance(minutes=11)
    with caplog.at_level(logging.WARNING, logger='marketplace'):
        # the same one again
        assert sweep(market) == {'confirmed': 0, 'failed': 0, 'resent': 1, 'repriced': 0, 'renumbered': 0}
    assert signed(market, release['id']) == [release['txHash']]
    assert any('--payout-max-fee-gwei' in record.getMessage() for record in caplog.records)


def test_a_crash_between_resigning_and_sending_leaves_the_new_transaction_stored_for_the_next_sweep(market, node):
    job, release = released(market, node)
    mp.CLOCK.advance(minutes=11)
    onchain = market.client.app.service.settings.onchain
    onchain.fees = (3 * GWEI, 2 * 10 ** 6)
    payment = dict(stored(market, release['txHash']), tbl='payments')
    repriced = onchain.reprice(db_of(market), payment)       # stored in its transaction; the process dies here
    row = db_of(market).row('SELECT * FROM payments WHERE id = :id', {'id': release['id']})
    assert (row['tx_hash'], row['raw_tx'], row['broadcast_at']) == (repriced['tx_hash'], repriced['raw_tx'], None)
    sent = len(node.sent)
    assert sweep(market) == {'confirmed': 0, 'failed': 0, 'resent': 0, 'repriced': 0, 'renumbered': 0}
    assert node.sent[sent:] == [repriced['raw_tx']]          # broadcast (the stored one, unsent) before confirming
    assert stored(market, repriced['tx_hash'])['broadcast_at'] is not None


# ----- secrets out of logs -----

@pytest.mark.parametrize('url, shown', [
    ('https://base-mainnet.g.alchemy.com/v2/SECRETKEY123', 'https://base-mainnet.g.alchemy.com'),
    ('http://127.0.0.1:8545/v2/SECRETKEY123?apikey=SECRET456', 'http://127.0.0.1:8545'),
    ('https://user:pass@node.example:8443/path#frag', 'https://node.example:8443'),
    ('http://[::1]:8545/key', 'http://[::1]:8545'),
    ('', ''),
    ('not a url', '[redacted]'),
])
def test_redact_url_keeps_scheme_host_and_port(url, shown):
    assert redact_url(url) == shown


def test_the_log_filter_blanks_secrets_in_messages_arguments_and_tracebacks():
    secret_filter = SecretFilter(mp.setting_secrets(mp.Settings(
        rpc_url='http://127.0.0.1:1/v2/SECRETKEY123?apikey=SECRET456', escrow_key='0x' + 'ab' * 32,
        admin_key='admin-' + 'k' * 40)))
    try:
        raise requests.ConnectionError("HTTPConnectionPool(host='127.0.0.1', port=1): Max retries exceeded with "
                                       "url: /v2/SECRETKEY123?apikey=SECRET456")
    except requests.ConnectionError:
        record = logging.LogRecord('urllib3', logging.WARNING, __file__, 1, 'failed %s with %s and key %s',
                                   ('http://127.0.0.1:1/v2/SECRETKEY123?apikey=SECRET456', 'ab' * 32,
                                    'admin-' + 'k' * 40), sys.exc_info())
    assert secret_filter.filter(record) is True
    text = logging.Formatter().format(record)
    for secret in ('SECRETKEY123', 'SECRET456', 'ab' * 32, 'k' * 40):
        assert secret not in text
    assert 'failed [redacted] with [redacted] and key [redacted]' in text
    assert 'ConnectionError' in text
