"""Ethereum addresses: format and EIP-55 mixed-case checksums."""

import re

from Crypto.Hash import keccak

_ADDRESS = re.compile(r'^0x[0-9a-fA-F]{40}$')


def to_checksum_address(address):
    """Return the EIP-55 mixed-case form of a 0x-prefixed 40-hex-digit address."""
    hex_part = address[2:].lower()
    digest = keccak.new(digest_bits=256, data=hex_part.encode('ascii')).hexdigest()
    return '0x' + ''.join(c.upper() if int(d, 16) >= 8 else c for c, d in zip(hex_part, digest))


def address_problem(address):
    """Say what is wrong with an address, or return None when it is valid.

    All-lowercase and all-uppercase addresses carry no checksum and are accepted; a mixed-case
    address must match its EIP-55 checksum, which catches most typing mistakes.
    """
    if not isinstance(address, str) or not _ADDRESS.fullmatch(address):
        return 'must be 0x followed by 40 hexadecimal digits'
    hex_part = address[2:]
    if hex_part not in (hex_part.lower(), hex_part.upper()) and to_checksum_address(address) != address:
        return 'has an invalid EIP-55 checksum (mixed case must match the checksum exactly)'
    return None
