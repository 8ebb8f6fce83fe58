"""The local chain harness (tests/chain.py) and the test token (fixtures/TestUSDC.sol) on anvil."""

import pytest

# web3 and eth_account come through chain.py, which keeps the recursion limit as it was (see there).
from chain import (CHAIN_ID, DEV_ADDRESSES, DEV_KEYS, DISCARD, OTHER_TOKEN, USDC, Account, ContractLogicError,
                   TransactionNotFound, Web3, sign_authorization, token_artifact)

USDC_UNIT = 10**6


def funded_account(chain, usdc_amount=0):
    """A fresh account with gas money and `usdc_amount` base units of USDC."""
    account = Account.create()
    chain.set_eth(account.address, 10**18)
    if usdc_amount:
        chain.mint(account.address, usdc_amount)
    return account


def domain_separator(chain_id, token, name='USD Coin', version='2'):
    def word(value):
        return value.to_bytes(32, 'big')
    keccak = Web3.keccak
    return keccak(keccak(b'EIP712Domain(string name,string version,uint256 chainId,address verifyingContract)')
                  + keccak(name.encode()) + keccak(version.encode()) + word(chain_id)
                  + bytes(12) + bytes.fromhex(token[2:]))


# ----- the node -----

def test_the_node_is_local_on_chain_8453(anvil):
    assert anvil.url.startswith('http://127.0.0.1:')
    assert anvil.rpc('eth_chainId') == hex(8453) == '0x2105'
    assert anvil.w3.eth.chain_id == CHAIN_ID
    assert anvil.w3.eth.get_balance(DEV_ADDRESSES[0]) > 10**18


def test_token_code_sits_at_the_usdc_address(anvil, usdc):
    assert usdc.address == USDC
    assert '0x' + bytes(anvil.w3.eth.get_code(USDC)).hex() == token_artifact()['deployedBytecode']
    assert usdc.functions.name().call() == 'USD Coin'
    assert usdc.functions.symbol().call() == 'USDC'
    assert usdc.functions.decimals().call() == 6
    assert usdc.functions.version().call() == '2'
    assert usdc.functions.totalSupply().call() == 0
    # The EIP-712 domain comes from the chain id and the address the code runs at, not a constructor.
    assert usdc.functions.DOMAIN_SEPARATOR().call() == domain_separator(8453, USDC)
    other = anvil.token(OTHER_TOKEN)
    assert other.functions.DOMAIN_SEPARATOR().call() == domain_separator(8453, OTHER_TOKEN)


# ----- ERC-20 -----

def test_mint_and_transfer_move_balances_and_log_transfers(anvil, usdc):
    payer, recipient = funded_account(anvil), Account.create().address
    anvil.mint(payer.address, 5 * USDC_UNIT)
    assert anvil.balance(payer.address) == 5 * USDC_UNIT
    assert usdc.functions.totalSupply().call() == 5 * USDC_UNIT

    tx_hash = anvil.transfer(payer.key, recipient, 2 * USDC_UNIT)
    assert anvil.balance(payer.address) == 3 * USDC_UNIT
    assert anvil.balance(recipient) == 2 * USDC_UNIT

    receipt = anvil.receipt(tx_hash)
    assert receipt['status'] == 1 and receipt['from'] == payer.address and receipt['to'] == USDC
    [log] = receipt['logs']
    assert log['address'] == USDC
    [event] = usdc.events.Transfer().process_receipt(receipt)
    assert event['address'] == USDC
    assert dict(event['args']) == {'from': payer.address, 'to': recipient, 'value': 2 * USDC_UNIT}


def test_a_transfer_above_the_balance_reverts(anvil, usdc):
    payer = funded_account(anvil, USDC_UNIT)
    with pytest.raises(ContractLogicError, match='exceeds balance'):
        anvil.transfer(payer.key, DEV_ADDRESSES[1], USDC_UNIT + 1)
    # With a fixed gas limit nothing is estimated: the transaction is mined, with status 0 and no log.
    receipt = anvil.receipt(anvil.transfer(payer.key, DEV_ADDRESSES[1], USDC_UNIT + 1, gas=100_000))
    assert receipt['status'] == 0 and receipt['logs'] == []
    assert anvil.balance(payer.address) == USDC_UNIT


def test_approve_and_transfer_from(anvil, usdc):
    owner, spender = funded_account(anvil, 10 * USDC_UNIT), funded_account(anvil)
    anvil.send(usdc.functions.approve(spender.address, 4 * USDC_UNIT), owner.key)
    assert usdc.functions.allowance(owner.address, spender.address).call() == 4 * USDC_UNIT
    anvil.send(usdc.functions.transferFrom(owner.address, DEV_ADDRESSES[2], 3 * USDC_UNIT), spender.key)
    assert usdc.functions.allowance(owner.address, spender.address).call() == USDC_UNIT
    assert anvil.balance(DEV_ADDRESSES[2]) == 3 * USDC_UNIT
    with pytest.raises(ContractLogicError, match='exceeds allowance'):
        anvil.send(usdc.functions.transferFrom(owner.address, DEV_ADDRESSES[2], 2 * USDC_UNIT), spender.key)


def test_the_other_token_is_a_separate_contract(anvil, usdc):
    payer = funded_account(anvil)
    anvil.mint(payer.address, 7, token=OTHER_TOKEN)
    receipt = anvil.receipt(anvil.transfer(payer.key, DEV_ADDRESSES[1], 7, token=OTHER_TOKEN))
    assert [log['address'] for log in receipt['logs']] == [OTHER_TOKEN]
    assert anvil.balance(DEV_ADDRESSES[1], token=OTHER_TOKEN) == 7
    assert anvil.balance(DEV_ADDRESSES[1]) == 0
    # web3 decodes a matching Transfer log from any contract: only the log's address tells them apart.
    assert usdc.events.Transfer().process_receipt(receipt)[0]['address'] == OTHER_TOKEN


# ----- EIP-3009 -----

def test_transfer_with_authorization_moves_funds_once(anvil, usdc):
    payer, payee = funded_account(anvil, 3 * USDC_UNIT), Account.create().address
    signed = sign_authorization(payer.key, payee, 2 * USDC_UNIT, *anvil.window())
    nonce = bytes.fromhex(signed['authorization']['nonce'][2:])
    assert usdc.functions.authorizationState(payer.address, nonce).call() is False

    # The relayer (a dev account) pays the gas; the payer needs no ETH for this.
    receipt = anvil.receipt(anvil.transfer_with_authorization(signed, key=DEV_KEYS[3]))
    assert receipt['status'] == 1 and receipt['from'] == DEV_ADDRESSES[3]
    assert anvil.balance(payer.address) == USDC_UNIT
    assert anvil.balance(payee) == 2 * USDC_UNIT
    assert usdc.functions.authorizationState(payer.address, nonce).call() is True
    [used] = usdc.events.AuthorizationUsed().process_receipt(receipt, errors=DISCARD)
    assert dict(used['args']) == {'authorizer': payer.address, 'nonce': nonce}
    [transfer] = usdc.events.Transfer().process_receipt(receipt, errors=DISCARD)
    assert dict(transfer['args']) == {'from': payer.address, 'to': payee, 'value': 2 * USDC_UNIT}

    with pytest.raises(ContractLogicError, match='authorization is used'):
        anvil.transfer_with_authorization(signed)
    assert anvil.balance(payee) == 2 * USDC_UNIT


def test_the_65_byte_signature_form_works_too(anvil, usdc):
    payer = funded_account(anvil, USDC_UNIT)
    signed = sign_authorization(payer.key, DEV_ADDRESSES[1], USDC_UNIT, *anvil.window())
    auth = signed['authorization']
    call = usdc.get_function_by_signature(
        'transferWithAuthorization(address,address,uint256,uint256,uint256,bytes32,bytes)')(
        auth['from'], auth['to'], int(auth['value']), int(auth['validAfter']), int(auth['validBefore']),
        bytes.fromhex(auth['nonce'][2:]), bytes.fromhex(signed['signature'][2:]))
    anvil.send(call, DEV_KEYS[0])
    assert anvil.balance(DEV_ADDRESSES[1]) == USDC_UNIT


def test_an_expired_authorization_reverts(anvil, usdc):
    payer = funded_account(anvil, USDC_UNIT)
    now = anvil.timestamp()
    with pytest.raises(ContractLogicError, match='authorization is expired'):
        anvil.transfer_with_authorization(sign_authorization(payer.key, DEV_ADDRESSES[1], 1, valid_before=now - 1))
    # validBefore is exclusive: a block at exactly validBefore is too late.
    anvil.set_next_timestamp(now + 100)
    tx_hash = anvil.transfer_with_authorization(
        sign_authorization(payer.key, DEV_ADDRESSES[1], 1, valid_before=now + 100), gas=200_000)
    assert anvil.receipt(tx_hash)['status'] == 0
    assert anvil.balance(payer.address) == USDC_UNIT


def test_a_not_yet_valid_authorization_reverts_until_its_time(anvil, usdc):
    payer = funded_account(anvil, USDC_UNIT)
    now = anvil.window(0, 0)[1]         # after every clock: not yet valid, however old the newest block is
    signed = sign_authorization(payer.key, DEV_ADDRESSES[1], USDC_UNIT, valid_after=now + 3600,
                                valid_before=now + 7200)
    with pytest.raises(ContractLogicError, match='authorization is not yet valid'):
        anvil.transfer_with_authorization(signed)
    anvil.set_next_timestamp(now + 3601)  # the next block is inside the window
    assert anvil.receipt(anvil.transfer_with_authorization(signed, gas=200_000))['status'] == 1
    assert anvil.timestamp() == now + 3601
    assert anvil.balance(DEV_ADDRESSES[1]) == USDC_UNIT


def test_a_bad_signature_reverts(anvil, usdc):
    payer, thief = funded_account(anvil, 5 * USDC_UNIT), Account.create()
    valid_after, valid_before = anvil.window()

    def signed(**changes):
        return sign_authorization(payer.key, thief.address, USDC_UNIT, valid_after, valid_before, **changes)

    forged = signed()
    forged['authorization']['value'] = str(5 * USDC_UNIT)  # altered after signing
    not_the_payer = sign_authorization(thief.key, thief.address, USDC_UNIT, valid_after, valid_before)
    not_the_payer['authorization']['from'] = payer.address  # signed by someone else
    mangled = signed()
    mangled['signature'] = mangled['signature'][:-2] + '1f'  # v = 31
    for bad in [forged, not_the_payer, mangled, signed(chain_id=1), signed(token=OTHER_TOKEN),
                signed(name='USDC'), signed(version='1')]:
        with pytest.raises(ContractLogicError, match='invalid signature'):
            anvil.transfer_with_authorization(bad)
    assert anvil.balance(payer.address) == 5 * USDC_UNIT
    # A signature for the other token's domain is good there (and only there).
    anvil.mint(payer.address, USDC_UNIT, token=OTHER_TOKEN)
    anvil.transfer_with_authorization(signed(token=OTHER_TOKEN), token=OTHER_TOKEN)
    assert anvil.balance(thief.address, token=OTHER_TOKEN) == USDC_UNIT


# ----- the harness: blocks, time, snapshots, pending transactions, reorgs -----

def test_mine_and_set_the_next_timestamp(anvil, usdc):
    start = anvil.block_number()
    anvil.mine(3)
    assert anvil.block_number() == start + 3
    later = anvil.timestamp() + 86_400
    anvil.set_next_timestamp(later)
    anvil.mine()
    assert anvil.timestamp() == later
    anvil.mine(2, interval=12)
    # Blocks `interval` apart; the first of them also carries whatever wall-clock time passed since the last block
    # (anvil's clock runs on): a busy machine made it later + 25 once, so only the gap between them is exact.
    last = anvil.block_number()
    first, second = (anvil.w3.eth.get_block(number)['timestamp'] for number in (last - 1, last))
    assert second - first == 12 and first >= later + 12


def test_snapshot_and_revert(anvil, usdc):
    snapshot, block, time_now = anvil.snapshot(), anvil.block_number(), anvil.timestamp()
    anvil.mint(DEV_ADDRESSES[4], 99)
    anvil.set_next_timestamp(time_now + 10_000)
    anvil.mine(5)
    anvil.revert(snapshot)
    assert anvil.balance(DEV_ADDRESSES[4]) == 0
    assert anvil.block_number() == block
    assert anvil.timestamp() == time_now


def test_a_transaction_stays_pending_without_automine(anvil, usdc):
    payer = funded_account(anvil, USDC_UNIT)
    anvil.automine(False)
    tx_hash = anvil.transfer(payer.key, DEV_ADDRESSES[1], USDC_UNIT, wait=False)
    with pytest.raises(TransactionNotFound):
        anvil.receipt(tx_hash)
    anvil.mine()
    assert anvil.receipt(tx_hash)['status'] == 1
    anvil.automine(True)


def test_a_reorg_drops_a_mined_transaction(anvil, usdc):
    payer = funded_account(anvil, USDC_UNIT)
    tx_hash = anvil.transfer(payer.key, DEV_ADDRESSES[1], USDC_UNIT)
    receipt = anvil.receipt(tx_hash)
    anvil.mine(2)
    anvil.reorg(3)
    assert anvil.w3.eth.get_block(receipt['blockNumber'])['hash'] != receipt['blockHash']
    with pytest.raises(TransactionNotFound):
        anvil.receipt(tx_hash)
    assert anvil.balance(DEV_ADDRESSES[1]) == 0
    assert anvil.balance(payer.address) == USDC_UNIT
