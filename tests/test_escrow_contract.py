"""contracts/JobEscrow.sol on anvil, as an attacker would test it (CONTRACT.md sections 21 and 25): every way money
leaves, and every role (a stranger, the payer, the arbiter, the guardian, the fee recipient) trying what it must not.

The committed artifact is rebuilt by the pinned solc and compared; a hypothesis test runs random sequences of
calls and checks after each that the contract holds exactly the sum of what remains, and that nobody but a payer,
a payee the payer or an executed proposal named, or the fee recipient ever received a token."""

import json
import secrets
import shutil
import subprocess
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chain import DEV_KEYS, DISCARD, USDC, Account, ContractLogicError, Web3

ROOT = Path(__file__).resolve().parent.parent
ARTIFACT = ROOT / 'contracts' / 'JobEscrow.json'
DELAY = 3600                  # arbiterDelay: the least the contract takes
MAX_FEE_BPS = 500             # 5 %
DAY = 86400
ARBITER, GUARDIAN, FEES, RELAYER = (Account.from_key(key) for key in DEV_KEYS[1:5])
RELEASE_TYPES = {'Release': [{'name': 'id', 'type': 'bytes32'}, {'name': 'claim', 'type': 'bytes32'},
                             {'name': 'payee', 'type': 'address'}, {'name': 'amount', 'type': 'uint256'},
                             {'name': 'fee', 'type': 'uint256'}]}
CLAIM = Web3.keccak(text='a claim id')
RECEIVE_TYPES = {'ReceiveWithAuthorization': [
    {'name': 'from', 'type': 'address'}, {'name': 'to', 'type': 'address'}, {'name': 'value', 'type': 'uint256'},
    {'name': 'validAfter', 'type': 'uint256'}, {'name': 'validBefore', 'type': 'uint256'},
    {'name': 'nonce', 'type': 'bytes32'}]}


def artifact():
    return json.loads(ARTIFACT.read_text())


def test_the_committed_artifact_is_what_the_pinned_solc_builds(tmp_path):
    node = shutil.which('node')
    if node is None:
        pytest.skip('node is not installed: make test installs solc with npm, which needs it')
    built = subprocess.run([node, str(ROOT / 'contracts' / 'compile.js'), str(tmp_path)], cwd=ROOT,
                           capture_output=True, text=True, timeout=120)
    assert built.returncode == 0, built.stderr
    assert json.loads((tmp_path / 'JobEscrow.json').read_text()) == artifact()
    assert (tmp_path / 'TestUSDC.json').read_text() == (ROOT / 'fixtures' / 'TestUSDC.json').read_text()
    assert artifact()['compiler'].startswith('solc 0.8.37')


class Escrow:
    """A deployed JobEscrow and the chain, with the calls of each role."""

    def __init__(self, chain, token, contract):
        self.chain, self.token, self.contract = chain, token, contract
        self.address = contract.address

    def call(self, function, *args, key):
        """Send a call signed with `key`; ContractLogicError (its reason) when the contract refuses it."""
        return self.chain.send(getattr(self.contract.functions, function)(*args), key)

    def refused(self, function, *args, key, reason):
        with pytest.raises(ContractLogicError, match=reason):
            self.call(function, *args, key=key)

    def funded_payer(self, amount):
        payer = Account.create()
        self.chain.set_eth(payer.address, 10**18)
        self.chain.mint(payer.address, amount)
        return payer

    def deposit(self, payer, amount, account=b'\x01' * 32, refund_after=None, salt=None):
        """approve + deposit by the payer; the deposit's id."""
        refund_after = refund_after or self.chain.timestamp() + 30 * DAY
        salt = salt or secrets.token_bytes(32)
        self.chain.send(self.token.functions.approve(self.address, amount), payer.key)
        self.call('deposit', account, amount, refund_after, salt, key=payer.key)
        return self.contract.functions.depositId(payer.address, account, refund_after, salt).call()

    def authorization(self, payer, amount, account, refund_after, salt, nonce=None):
        """The payer's EIP-3009 ReceiveWithAuthorization to the contract whose nonce is the deposit id."""
        nonce = nonce or self.contract.functions.depositId(payer.address, account, refund_after, salt).call()
        valid_after, valid_before = self.chain.window()
        signed = Account.sign_typed_data(payer.key, domain_data={
            'name': 'USD Coin', 'version': '2', 'chainId': self.chain.chain_id, 'verifyingContract': USDC},
            message_types=RECEIVE_TYPES, message_data={
                'from': payer.address, 'to': self.address, 'value': amount, 'validAfter': valid_after,
                'validBefore': valid_before, 'nonce': nonce})
        return valid_after, valid_before, bytes(signed.signature)

    def release_signature(self, key, deposit_id, payee, amount, fee, chain_id=None, contract=None, claim=CLAIM,
                          version='2'):
        signed = Account.sign_typed_data(key, domain_data={
            'name': 'JobEscrow', 'version': version, 'chainId': chain_id or self.chain.chain_id,
            'verifyingContract': contract or self.address},
            message_types=RELEASE_TYPES, message_data={'id': deposit_id, 'claim': claim, 'payee': payee,
                                                       'amount': amount, 'fee': fee})
        return bytes(signed.signature)

    def release_args(self, payer_key, deposit_id, payee, amount, fee, claim=CLAIM):
        """release's arguments signed by the payer and the arbiter both."""
        return (deposit_id, claim, payee, amount, fee,
                self.release_signature(payer_key, deposit_id, payee, amount, fee, claim=claim),
                self.release_signature(ARBITER.key, deposit_id, payee, amount, fee, claim=claim))

    def remaining(self, deposit_id):
        return self.contract.functions.deposits(deposit_id).call()[2]

    def balance(self, address):
        return self.chain.balance(address)

    def events(self, tx_hash, name):
        receipt = self.chain.receipt(tx_hash)
        return [dict(event['args']) for event in getattr(self.contract.events, name)().process_receipt(receipt, errors=DISCARD)]


def deploy(chain, *args, key=DEV_KEYS[0]):
    spec = artifact()
    factory = chain.w3.eth.contract(abi=spec['abi'], bytecode=spec['bytecode'])
    tx_hash = chain.send(factory.constructor(*args), key)
    return chain.w3.eth.contract(address=chain.receipt(tx_hash)['contractAddress'], abi=spec['abi'])


@pytest.fixture
def escrow(usdc, anvil):
    contract = deploy(anvil, USDC, ARBITER.address, GUARDIAN.address, FEES.address, MAX_FEE_BPS, DELAY)
    return Escrow(anvil, usdc, contract)


def test_the_constructor_refuses_a_short_delay_a_fee_cap_over_100_and_the_arbiter_as_fee_recipient_or_guardian(anvil,
                                                                                                               usdc):
    good = [USDC, ARBITER.address, GUARDIAN.address, FEES.address, MAX_FEE_BPS, DELAY]
    for change, reason in [((5, 3599), 'under an hour'), ((4, 10_001), 'over 100'), ((3, ARBITER.address), 'fee'),
                           ((2, ARBITER.address), 'guardian'), ((0, '0x' + '00' * 20), 'zero address')]:
        args = list(good)
        args[change[0]] = change[1]
        with pytest.raises(ContractLogicError, match=reason):
            deploy(anvil, *args)
    contract = deploy(anvil, *good)
    assert (contract.functions.arbiter().call(), contract.functions.guardian().call(),
            contract.functions.feeRecipient().call(), contract.functions.maxFeeBps().call(),
            contract.functions.arbiterDelay().call()) == (ARBITER.address, GUARDIAN.address, FEES.address, 500, 3600)


def test_a_release_signed_by_the_payer_and_the_arbiter_pays_the_payee_and_the_fee_once(escrow):
    payer, worker = escrow.funded_payer(25_000_000), Account.create()
    deposit_id = escrow.deposit(payer, 25_000_000)
    assert escrow.contract.functions.deposits(deposit_id).call()[:3] == [payer.address, b'\x01' * 32, 25_000_000]
    args = escrow.release_args(payer.key, deposit_id, worker.address, 19_000_000, 1_000_000)
    stranger = escrow.funded_payer(0)
    tx = escrow.call('release', *args, key=stranger.key)
    assert escrow.events(tx, 'Released') == [{'id': deposit_id, 'payee': worker.address, 'amount': 19_000_000,
                                              'fee': 1_000_000, 'bySignature': True}]
    assert (escrow.balance(worker.address), escrow.balance(FEES.address), escrow.remaining(deposit_id),
            escrow.balance(escrow.address)) == (19_000_000, 1_000_000, 5_000_000, 5_000_000)
    escrow.refused('release', *args, key=stranger.key, reason='signature spent')
    # the malleated twin (s -> n - s, v flipped) of either signature has the same digest: spent too
    n = 0xfffffffffffffffffffffffffffffffebaaedce6af48a03bbfd25e8cd0364141
    for which in (5, 6):
        signature = args[which]
        r, s, v = signature[:32], int.from_bytes(signature[32:64], 'big'), signature[64]
        twin = list(args)
        twin[which] = r + (n - s).to_bytes(32, 'big') + bytes([55 - v])
        escrow.refused('release', *twin, key=stranger.key, reason='signature spent')
    # the same share again for another claim is another release (two equal shares of one job to one wallet)
    escrow.call('release', *escrow.release_args(payer.key, deposit_id, worker.address, 4_750_000, 250_000,
                                                claim=Web3.keccak(text='another claim')), key=stranger.key)
    assert (escrow.balance(worker.address), escrow.remaining(deposit_id)) == (23_750_000, 0)


def test_a_payer_cannot_pay_itself_back_nor_a_stolen_arbiter_key_pay_itself(escrow):
    """The attack of round 4: the requester signs a Release to its own wallet and sends it itself, before
    refundAfter. And the arbiter's key alone, stolen, signs one to the thief."""
    payer, worker = escrow.funded_payer(25_000_000), Account.create()
    deposit_id = escrow.deposit(payer, 25_000_000)
    own = escrow.release_signature(payer.key, deposit_id, payer.address, 25_000_000, 0)
    for arbiter_signature in (own, b'', b'\x00' * 65,
                              escrow.release_signature(payer.key, deposit_id, payer.address, 25_000_000, 0,
                                                       claim=Web3.keccak(text='x'))):
        escrow.refused('release', deposit_id, CLAIM, payer.address, 25_000_000, 0, own, arbiter_signature,
                       key=payer.key, reason="not the arbiter's signature")
    thief = ARBITER.address
    stolen = escrow.release_signature(ARBITER.key, deposit_id, thief, 25_000_000, 0)
    for payer_signature in (stolen, b''):
        escrow.refused('release', deposit_id, CLAIM, thief, 25_000_000, 0, payer_signature, stolen,
                       key=ARBITER.key, reason="not the payer's signature")
    # what the server's key co-signs (the worker's share) the payer cannot turn to itself: the payee is signed
    worker_args = escrow.release_args(payer.key, deposit_id, worker.address, 25_000_000, 0)
    escrow.refused('release', deposit_id, CLAIM, payer.address, 25_000_000, 0, *worker_args[5:], key=payer.key,
                   reason="not the payer's signature")
    assert (escrow.balance(payer.address), escrow.remaining(deposit_id)) == (0, 25_000_000)


def test_a_release_is_refused_when_signed_for_another_deposit_claim_chain_contract_or_version(escrow):
    payer, worker = escrow.funded_payer(20_000_000), Account.create()
    first, second = escrow.deposit(payer, 10_000_000), escrow.deposit(payer, 10_000_000)
    other = deploy(escrow.chain, USDC, ARBITER.address, GUARDIAN.address, FEES.address, MAX_FEE_BPS, DELAY).address
    for key, deposit_id, options in [
            (worker.key, first, {}), (GUARDIAN.key, first, {}),                          # not the payer
            (payer.key, second, {}),                                                    # signed for the other deposit
            (payer.key, first, {'claim': Web3.keccak(text='another claim')}),
            (payer.key, first, {'version': '1'}),                                       # the old contract's domain
            (payer.key, first, {'chain_id': 84532}), (payer.key, first, {'contract': other})]:
        signature = escrow.release_signature(key, deposit_id, worker.address, 10_000_000, 0, **options)
        arbiter = escrow.release_signature(ARBITER.key, first, worker.address, 10_000_000, 0)
        escrow.refused('release', first, CLAIM, worker.address, 10_000_000, 0, signature, arbiter, key=RELAYER.key,
                       reason="not the payer's signature")
    args = list(escrow.release_args(payer.key, first, worker.address, 10_000_000, 0))
    escrow.refused('release', *(args[:3] + [9_000_000] + args[4:]), key=RELAYER.key,
                   reason="not the payer's signature")     # another amount than signed
    escrow.refused('release', *(args[:5] + [args[5][:64], args[6]]), key=RELAYER.key,
                   reason="not the payer's signature")     # 64 bytes
    assert escrow.balance(escrow.address) == 20_000_000


def test_the_fee_cap_and_what_remains_bound_every_payout(escrow):
    payer, worker = escrow.funded_payer(10_000_000), Account.create()
    deposit_id = escrow.deposit(payer, 10_000_000)
    over_cap = escrow.release_args(payer.key, deposit_id, worker.address, 9_400_000, 600_000)   # 6 % > 5 %
    escrow.refused('release', *over_cap, key=RELAYER.key, reason='fee over the cap')
    too_much = escrow.release_args(payer.key, deposit_id, worker.address, 10_000_000, 1)
    escrow.refused('release', *too_much, key=RELAYER.key, reason='more than remains')
    escrow.refused('propose', deposit_id, [worker.address], [9_000_000], 1_000_000, key=ARBITER.key,
                   reason='fee over the cap')
    at_cap = escrow.release_args(payer.key, deposit_id, worker.address, 9_500_000, 500_000)
    escrow.call('release', *at_cap, key=RELAYER.key)
    assert (escrow.balance(worker.address), escrow.balance(FEES.address), escrow.remaining(deposit_id)) == \
        (9_500_000, 500_000, 0)


def test_only_the_arbiter_refunds_and_only_to_the_payer(escrow):
    payer = escrow.funded_payer(10_000_000)
    deposit_id = escrow.deposit(payer, 10_000_000)
    for role in (payer, GUARDIAN, FEES, escrow.funded_payer(0)):
        escrow.refused('refund', deposit_id, 1, key=role.key, reason='only the arbiter')
    escrow.refused('refund', deposit_id, 10_000_001, key=ARBITER.key, reason='amount')
    tx = escrow.call('refund', deposit_id, 4_000_000, key=ARBITER.key)
    assert escrow.events(tx, 'Refunded') == [{'id': deposit_id, 'payer': payer.address, 'amount': 4_000_000}]
    assert (escrow.balance(payer.address), escrow.remaining(deposit_id), escrow.balance(ARBITER.address)) == \
        (4_000_000, 6_000_000, 0)


def test_a_stolen_arbiter_key_proposes_everything_to_itself_and_the_guardian_cancels_every_cent_stays(escrow):
    payers = [escrow.funded_payer(amount) for amount in (7_000_000, 13_000_000)]
    deposits = [escrow.deposit(payer, amount) for payer, amount in zip(payers, (7_000_000, 13_000_000))]
    thief = ARBITER.address
    for deposit_id, amount in zip(deposits, (7_000_000, 13_000_000)):
        tx = escrow.call('propose', deposit_id, [thief], [amount], 0, key=ARBITER.key)
        event = escrow.events(tx, 'Proposed')[0]
        assert event['executableAt'] == escrow.chain.timestamp() + DELAY
        escrow.refused('execute', deposit_id, key=ARBITER.key, reason='too early')
        escrow.refused('propose', deposit_id, [thief], [1], 0, key=ARBITER.key, reason='pending')
    for role in (payers[0], FEES, escrow.funded_payer(0)):
        escrow.refused('cancel', deposits[0], key=role.key, reason='only the guardian or the arbiter')
    for deposit_id in deposits:
        tx = escrow.call('cancel', deposit_id, key=GUARDIAN.key)
        assert escrow.events(tx, 'Cancelled') == [{'id': deposit_id, 'by': GUARDIAN.address}]
    escrow.chain.mine(1, DELAY + 1)
    escrow.chain.mine(1)
    for deposit_id in deposits:
        escrow.refused('execute', deposit_id, key=ARBITER.key, reason='no proposal')
    assert (escrow.balance(escrow.address), escrow.balance(thief)) == (20_000_000, 0)
    assert [escrow.remaining(deposit_id) for deposit_id in deposits] == [7_000_000, 13_000_000]


def test_a_proposal_runs_for_anyone_once_its_delay_has_passed(escrow):
    payer, a, b = escrow.funded_payer(10_000_000), Account.create(), Account.create()
    deposit_id = escrow.deposit(payer, 10_000_000)
    for role in (payer, GUARDIAN, FEES):
        escrow.refused('propose', deposit_id, [a.address], [1], 0, key=role.key, reason='only the arbiter')
    escrow.call('propose', deposit_id, [a.address, b.address], [6_000_000, 3_600_000], 400_000, key=ARBITER.key)
    assert escrow.contract.functions.proposals(deposit_id).call()[:3] == \
        [[a.address, b.address], [6_000_000, 3_600_000], 400_000]
    executable_at = escrow.contract.functions.proposals(deposit_id).call()[3]
    escrow.chain.set_next_timestamp(executable_at - 1)
    escrow.chain.mine()
    escrow.refused('execute', deposit_id, key=payer.key, reason='too early')
    escrow.chain.set_next_timestamp(executable_at + 1)
    tx = escrow.call('execute', deposit_id, key=escrow.funded_payer(0).key)
    assert escrow.events(tx, 'Released') == [
        {'id': deposit_id, 'payee': a.address, 'amount': 6_000_000, 'fee': 400_000, 'bySignature': False},
        {'id': deposit_id, 'payee': b.address, 'amount': 3_600_000, 'fee': 0, 'bySignature': False}]
    assert (escrow.balance(a.address), escrow.balance(b.address), escrow.balance(FEES.address),
            escrow.balance(escrow.address)) == (6_000_000, 3_600_000, 400_000, 0)
    escrow.refused('execute', deposit_id, key=payer.key, reason='no proposal')


def test_reclaim_before_and_after_refund_after_drops_a_pending_proposal(escrow):
    payer = escrow.funded_payer(10_000_000)
    refund_after = escrow.chain.timestamp() + 2 * DAY
    deposit_id = escrow.deposit(payer, 10_000_000, refund_after=refund_after)
    escrow.call('refund', deposit_id, 1_000_000, key=ARBITER.key)
    escrow.call('propose', deposit_id, [ARBITER.address], [9_000_000], 0, key=ARBITER.key)
    escrow.chain.set_next_timestamp(refund_after - 1)
    escrow.chain.mine()
    escrow.refused('reclaim', deposit_id, key=payer.key, reason='too early')
    escrow.chain.set_next_timestamp(refund_after)
    tx = escrow.call('reclaim', deposit_id, key=escrow.funded_payer(0).key)      # anyone
    assert escrow.events(tx, 'Reclaimed') == [{'id': deposit_id, 'payer': payer.address, 'amount': 9_000_000}]
    assert (escrow.balance(payer.address), escrow.remaining(deposit_id), escrow.balance(escrow.address)) == \
        (10_000_000, 0, 0)
    assert escrow.contract.functions.proposals(deposit_id).call()[3] == 0
    escrow.refused('execute', deposit_id, key=ARBITER.key, reason='no proposal')
    escrow.refused('reclaim', deposit_id, key=payer.key, reason='nothing remains')


def test_a_deposit_refuses_a_refund_after_too_soon_or_too_far_and_an_id_used_twice(escrow):
    payer = escrow.funded_payer(30_000_000)
    now, salt = escrow.chain.timestamp(), secrets.token_bytes(32)
    escrow.chain.send(escrow.token.functions.approve(escrow.address, 30_000_000), payer.key)
    escrow.refused('deposit', b'\x01' * 32, 1, now + DELAY, salt, key=payer.key, reason='too soon')
    escrow.refused('deposit', b'\x01' * 32, 1, now + 401 * DAY, salt, key=payer.key, reason='too far')
    escrow.refused('deposit', b'\x01' * 32, 0, now + 2 * DAY, salt, key=payer.key, reason='amount')
    escrow.call('deposit', b'\x01' * 32, 1_000_000, now + 2 * DAY, salt, key=payer.key)
    escrow.refused('deposit', b'\x01' * 32, 1_000_000, now + 2 * DAY, salt, key=payer.key, reason='id used')


def test_a_relayed_deposit_needs_no_eth_from_the_payer_and_binds_account_amount_and_refund_after(escrow):
    payer = Account.create()
    escrow.chain.mint(payer.address, 5_000_000)
    account, refund_after, salt = Web3.keccak(text='an account id'), escrow.chain.timestamp() + 10 * DAY, b'\x07' * 32
    valid_after, valid_before, signature = escrow.authorization(payer, 5_000_000, account, refund_after, salt)
    for changed in ({'account': Web3.keccak(text='another')}, {'amount': 4_000_000},
                    {'refund_after': refund_after + 1}):
        args = dict(account=account, amount=5_000_000, refund_after=refund_after)
        args.update(changed)
        escrow.refused('depositWithAuthorization', payer.address, args['account'], args['amount'],
                       args['refund_after'], salt, valid_after, valid_before, signature, key=RELAYER.key,
                       reason='invalid signature')
    tx = escrow.call('depositWithAuthorization', payer.address, account, 5_000_000, refund_after, salt, valid_after,
                     valid_before, signature, key=RELAYER.key)
    deposit_id = escrow.contract.functions.depositId(payer.address, account, refund_after, salt).call()
    assert escrow.events(tx, 'Deposited') == [{'id': deposit_id, 'payer': payer.address, 'account': account,
                                               'amount': 5_000_000, 'refundAfter': refund_after}]
    assert (escrow.balance(escrow.address), escrow.balance(payer.address),
            escrow.chain.w3.eth.get_balance(payer.address)) == (5_000_000, 0, 0)
    escrow.refused('depositWithAuthorization', payer.address, account, 5_000_000, refund_after, salt, valid_after,
                   valid_before, signature, key=RELAYER.key, reason='id used')
    # the same authorization sent to the token by anyone else than the contract is refused by the token
    receive = escrow.token.get_function_by_signature(
        'receiveWithAuthorization(address,address,uint256,uint256,uint256,bytes32,bytes)')
    with pytest.raises(ContractLogicError, match='caller must be the payee'):
        escrow.chain.send(receive(payer.address, escrow.address, 5_000_000, valid_after, valid_before,
                                  deposit_id, signature), RELAYER.key)


# Random sequences of calls by every role ------------------------------------------------------------------------

ACTIONS = st.lists(st.tuples(
    st.sampled_from(['deposit', 'release', 'self_release', 'refund', 'propose', 'execute', 'cancel', 'reclaim', 'wait',
                     'steal']),
    st.integers(0, 2),                  # which deposit
    st.integers(0, 12_000_000),         # an amount
    st.integers(0, 3)), min_size=1, max_size=14)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(actions=ACTIONS)
def test_random_calls_keep_the_balance_equal_to_what_remains_and_pay_only_those_allowed(escrow, actions):
    """After every call: the contract holds the sum of what remains; nobody was paid but a payer, a payee that
    both the payer and the arbiter signed for or an executed proposal named, or the fee recipient; and each payer
    got back exactly what the arbiter refunded plus what it reclaimed once refundAfter had passed."""
    chain = escrow.chain
    snapshot = chain.snapshot()
    try:
        payers = [escrow.funded_payer(40_000_000) for _ in range(3)]
        payees = [Account.create().address for _ in range(4)]
        deposits, allowed = [], {payer.address for payer in payers} | {FEES.address}
        watched = set(payees) | {ARBITER.address, GUARDIAN.address, RELAYER.address}
        returned = {payer.address: 0 for payer in payers}      # refunded by the arbiter, or reclaimed in time
        deposited = {payer.address: 0 for payer in payers}
        for step, (action, which, amount, pick) in enumerate(actions):
            payer = payers[which]
            deposit_id = deposits[which % len(deposits)] if deposits else None
            owner = escrow.contract.functions.deposits(deposit_id).call() if deposit_id else None
            owner_key = owner and next(p.key for p in payers if p.address == owner[0])
            try:
                if action == 'deposit' or deposit_id is None:
                    deposits.append(escrow.deposit(payer, max(amount, 1), refund_after=chain.timestamp() + 3 * DAY))
                    deposited[payer.address] += max(amount, 1)
                elif action == 'release':
                    fee = amount * MAX_FEE_BPS // 10_000 // 2
                    claim = Web3.keccak(text=f'claim {step}')
                    escrow.call('release', *escrow.release_args(owner_key, deposit_id, payees[pick], amount, fee,
                                                                claim=claim), key=RELAYER.key)
                    allowed.add(payees[pick])
                elif action == 'self_release':      # the payer's own Release to itself, with any arbiter signature
                    own = escrow.release_signature(owner_key, deposit_id, owner[0], amount, 0)
                    cosigned = escrow.release_signature(ARBITER.key, deposit_id, payees[pick], amount, 0)
                    with pytest.raises(ContractLogicError):
                        escrow.call('release', deposit_id, CLAIM, owner[0], amount, 0, own,
                                    (own, cosigned, b'')[pick % 3], key=owner_key)
                elif action == 'refund':
                    tx = escrow.call('refund', deposit_id, amount, key=ARBITER.key)
                    for event in escrow.events(tx, 'Refunded'):
                        returned[event['payer']] += event['amount']
                elif action == 'propose':
                    escrow.call('propose', deposit_id, [payees[pick]], [amount], 0, key=ARBITER.key)
                elif action == 'execute':
                    proposed = escrow.contract.functions.proposals(deposit_id).call()[0]
                    escrow.call('execute', deposit_id, key=RELAYER.key)
                    allowed.update(proposed)
                elif action == 'cancel':
                    escrow.call('cancel', deposit_id, key=(GUARDIAN, ARBITER)[pick % 2].key)
                elif action == 'reclaim':
                    tx = escrow.call('reclaim', deposit_id, key=(RELAYER, payers[which])[pick % 2].key)
                    mined_at = chain.w3.eth.get_block(chain.receipt(tx)['blockNumber'])['timestamp']
                    assert mined_at >= owner[3]
                    for event in escrow.events(tx, 'Reclaimed'):
                        returned[event['payer']] += event['amount']
                elif action == 'wait':
                    chain.mine(1, [60, DELAY, DAY, 3 * DAY][pick])
                    chain.mine(1)
                else:       # a stranger, the guardian or the fee recipient trying the arbiter's and the payer's calls
                    thief = (GUARDIAN, FEES, RELAYER, Account.from_key(DEV_KEYS[0]))[pick]
                    for function, args in (('refund', (deposit_id, 1)), ('propose', (deposit_id, [thief.address],
                                                                                      [1], 0))):
                        with pytest.raises(ContractLogicError):
                            escrow.call(function, *args, key=thief.key)
            except ContractLogicError:
                pass        # refused: nothing moved
            held = escrow.balance(escrow.address)
            assert held == sum(escrow.remaining(deposit_id) for deposit_id in deposits)
            for address in watched:
                assert address in allowed or escrow.balance(address) == 0, address
            for each in payers:
                assert escrow.balance(each.address) == 40_000_000 - deposited[each.address] + returned[each.address]
        assert sum(escrow.balance(address) for address in allowed | watched) + escrow.balance(escrow.address) == \
            sum(40_000_000 for _ in payers)
    finally:
        chain.revert(snapshot)
