"""verifier/escrow.py against the real contract on anvil: what the service signs (a deployment, relayed deposits,
refunds, proposals) is what the contract takes, what it reads is the contract's state at a block, and the typed
data it shows payers is what the contract and the token verify."""

import secrets

import pytest

from chain import DEV_KEYS, USDC, Account, Web3
import wiring
from verifier import escrow as contract_calls
from verifier.chain import Chain

ARBITER, GUARDIAN, FEES, RELAYER = (Account.from_key(key) for key in DEV_KEYS[1:5])
DAY = 86400


@pytest.fixture
def deployed(usdc, anvil):
    """(the chain as the service reads it, the contract's address)."""
    node = Chain(anvil.url)
    fees = node.fee_caps()
    raw, tx_hash = contract_calls.sign_deploy(
        ARBITER.key, token=USDC, arbiter=ARBITER.address, guardian=GUARDIAN.address, fee_recipient=FEES.address,
        max_fee_bps=300, arbiter_delay=7200, nonce=node.nonce(ARBITER.address), chain_id=anvil.chain_id,
        max_fee_per_gas=fees[0], max_priority_fee_per_gas=fees[1])
    assert node.send_raw(raw)
    receipt = anvil.w3.eth.wait_for_transaction_receipt(tx_hash, timeout=10)
    assert receipt['status'] == 1
    return node, receipt['contractAddress']


def send(node, anvil, key, contract, function, *args, gas=contract_calls.CALL_GAS):
    """Sign a call as the service does and send it; its receipt's status."""
    fees = node.fee_caps()
    raw, tx_hash = contract_calls.sign_call(
        key, contract=contract, data=contract_calls.call_data(function, *args),
        nonce=node.nonce(Account.from_key(key).address), chain_id=anvil.chain_id, max_fee_per_gas=fees[0],
        max_priority_fee_per_gas=fees[1], gas=gas)
    node.send_raw(raw)
    return anvil.w3.eth.wait_for_transaction_receipt(tx_hash, timeout=10)['status']


def test_a_deployment_signed_here_has_the_settings_asked(deployed):
    node, address = deployed
    assert contract_calls.EscrowReader(node, address).settings() == {
        'token': USDC, 'arbiter': ARBITER.address, 'guardian': GUARDIAN.address, 'feeRecipient': FEES.address,
        'maxFeeBps': 300, 'arbiterDelay': 7200, 'domainSeparator': contract_calls.domain_separator(address, 8453)}


def test_a_relayed_deposit_a_release_and_a_proposal_as_the_service_makes_them(deployed, anvil):
    node, address = deployed
    reader = contract_calls.EscrowReader(node, address)
    payer, worker = Account.create(), Account.create()
    anvil.mint(payer.address, 8_000_000)
    account = contract_calls.account_hash('4b1f0f52-4c8e-4b8e-9d43-5c1a2f0d9e11')
    assert account == Web3.keccak(text='4b1f0f52-4c8e-4b8e-9d43-5c1a2f0d9e11').to_0x_hex()
    refund_after, salt = anvil.timestamp() + 20 * DAY, '0x' + secrets.token_hex(32)
    deposit = contract_calls.deposit_id(payer.address, account, refund_after, salt)
    assert deposit == '0x' + reader.contract.functions.depositId(
        payer.address, bytes.fromhex(account[2:]), refund_after, bytes.fromhex(salt[2:])).call().hex()
    assert reader.deposit(deposit) is None
    valid_after, valid_before = anvil.window()
    typed = contract_calls.receive_typed_data(USDC, anvil.chain_id, payer.address, address, 8_000_000, valid_after,
                                              valid_before, deposit)
    signature = contract_calls.sign_typed_data(payer.key, typed)
    assert contract_calls.typed_data_signer(typed, signature) == payer.address
    assert send(node, anvil, RELAYER.key, address, 'depositWithAuthorization', payer.address, account, 8_000_000,
                refund_after, salt, valid_after, valid_before, signature) == 1
    block = node.block_number()
    assert reader.deposit(deposit, block) == {'payer': payer.address, 'account': account, 'remaining': 8_000_000,
                                              'refundAfter': refund_after}
    assert reader.deposit(deposit, block - 1) is None       # read at a block: before the deposit, nothing

    claim = contract_calls.claim_hash('7d0c2a9e-0b5f-4d61-9f4e-1c2b3a4d5e6f')
    assert claim == Web3.keccak(text='7d0c2a9e-0b5f-4d61-9f4e-1c2b3a4d5e6f').to_0x_hex()
    release = contract_calls.release_typed_data(address, anvil.chain_id, deposit, claim, worker.address, 5_000_000,
                                                150_000)
    assert release['message'] == {'id': deposit, 'claim': claim, 'payee': worker.address, 'amount': '5000000',
                                  'fee': '150000'}
    signed = contract_calls.sign_typed_data(payer.key, release)
    assert contract_calls.typed_data_signer(release, signed) == payer.address
    assert contract_calls.typed_data_signer(release, '0x1234') is None
    cosigned = contract_calls.sign_typed_data(ARBITER.key, release)
    assert send(node, anvil, RELAYER.key, address, 'release', deposit, claim, worker.address, 5_000_000, 150_000,
                signed, signed) == 0        # the payer's signature twice: the arbiter's is missing
    assert send(node, anvil, RELAYER.key, address, 'release', deposit, claim, worker.address, 5_000_000, 150_000,
                signed, cosigned) == 1
    assert (anvil.balance(worker.address), anvil.balance(FEES.address), reader.deposit(deposit)['remaining']) == \
        (5_000_000, 150_000, 2_850_000)

    assert send(node, anvil, ARBITER.key, address, 'propose', deposit, [worker.address], [2_800_000], 50_000) == 1
    pending = reader.pending_proposals()
    assert [(entry['id'], entry['payees'], entry['amounts'], entry['fee']) for entry in pending] == \
        [(deposit, [worker.address], [2_800_000], 50_000)]
    assert pending[0]['executableAt'] == anvil.timestamp() + 7200
    assert send(node, anvil, GUARDIAN.key, address, 'cancel', deposit) == 1
    assert reader.pending_proposals() == [] and reader.proposed_ids() == [deposit]
    assert send(node, anvil, ARBITER.key, address, 'refund', deposit, 2_850_000) == 1
    assert (anvil.balance(payer.address), anvil.balance(address), anvil.balance(ARBITER.address)) == \
        (2_850_000, 0, 0)


def test_escrow_deploy_checks_its_arguments_then_deploys_with_the_deployer_key(anvil, usdc, tmp_path, monkeypatch,
                                                                                capsys):
    deployer = Account.create()
    anvil.set_eth(deployer.address, 10**18)
    monkeypatch.setenv('MARKETPLACE_DEPLOYER_KEY', deployer.key.to_0x_hex())
    command = ['escrow', 'deploy', '--rpc-url', anvil.url, '--db', str(tmp_path / 'm.db'),
               '--arbiter', ARBITER.address, '--guardian', GUARDIAN.address, '--fee-recipient', FEES.address,
               '--max-fee-bps', '250', '--arbiter-delay-hours', '24']
    for flag, value, message in [('--arbiter-delay-hours', '0.5', 'at least 1'), ('--max-fee-bps', '10001', '10000'),
                                 ('--guardian', ARBITER.address.lower(), 'neither the guardian')]:
        wrong = list(command)
        wrong[wrong.index(flag) + 1] = value
        assert wiring.main(wrong) == 1
        assert message in capsys.readouterr().err
    assert anvil.w3.eth.get_transaction_count(deployer.address) == 0       # nothing was sent
    assert wiring.main(command) == 0
    address = capsys.readouterr().out.strip()
    assert contract_calls.EscrowReader(Chain(anvil.url), address).settings() == {
        'token': USDC, 'arbiter': ARBITER.address, 'guardian': GUARDIAN.address, 'feeRecipient': FEES.address,
        'maxFeeBps': 250, 'arbiterDelay': 86400,
        'domainSeparator': contract_calls.domain_separator(address, 8453)}      # the new JobEscrow: version 2
