// SPDX-License-Identifier: Apache-2.0
pragma solidity 0.8.37;

/// @title JobEscrow: each job's USDC held apart, that even the marketplace's operator cannot take.
/// @notice CONTRACT.md sections 21 and 25. A payer deposits for a job; the money leaves only
///         - to a payee both the payer and the arbiter approved by EIP-712 `Release` signatures naming the job's
///           claim (at once, by anyone: so a payer cannot pay itself back, and a worker holding both signatures
///           is paid even when the marketplace is down),
///         - back to the payer by the arbiter (the marketplace's server key: `refund`, at once),
///         - to anyone the arbiter proposes, once `arbiterDelay` has passed and unless the guardian (a key
///           kept offline) or the arbiter cancelled it (`propose`, `execute`, `cancel`),
///         - back to the payer by anyone once `refundAfter` has passed (`reclaim`).
///         No owner, no upgrade, no pause, no sweep of stray tokens. Every state change is made before the
///         token is called (checks, effects, interactions). NOT AUDITED.
contract JobEscrow {
    struct Deposit {
        address payer;
        bytes32 account;        // keccak256 of the posting account's id (UTF-8)
        uint256 remaining;      // base units of the token still held for this deposit
        uint64 refundAfter;     // from this time (block.timestamp >=) anyone may send `remaining` to the payer
    }

    struct Proposal {
        address[] payees;
        uint256[] amounts;
        uint256 fee;
        uint64 executableAt;    // 0: none pending
    }

    bytes32 private constant DOMAIN_TYPEHASH =
        keccak256("EIP712Domain(string name,string version,uint256 chainId,address verifyingContract)");
    bytes32 public constant RELEASE_TYPEHASH =
        keccak256("Release(bytes32 id,bytes32 claim,address payee,uint256 amount,uint256 fee)");
    uint256 private constant HALF_CURVE_ORDER = 0x7fffffffffffffffffffffffffffffff5d576e7357a4501ddfe92f46681b20a0;
    bytes4 private constant ERC1271_MAGIC = 0x1626ba7e;
    uint256 public constant MAX_PAYEES = 32;
    uint256 public constant MAX_AHEAD = 400 days;

    IUSDC public immutable token;
    address public immutable arbiter;
    address public immutable guardian;
    address public immutable feeRecipient;
    uint16 public immutable maxFeeBps;
    uint32 public immutable arbiterDelay;

    mapping(bytes32 => Deposit) public deposits;
    mapping(bytes32 => Proposal) private _proposals;
    mapping(bytes32 => bool) public spentReleases;     // by EIP-712 digest: a malleated twin has the same digest

    event Deposited(bytes32 indexed id, address indexed payer, bytes32 account, uint256 amount, uint64 refundAfter);
    event Released(bytes32 indexed id, address indexed payee, uint256 amount, uint256 fee, bool bySignature);
    event Refunded(bytes32 indexed id, address indexed payer, uint256 amount);
    event Proposed(bytes32 indexed id, address[] payees, uint256[] amounts, uint256 fee, uint64 executableAt);
    event Cancelled(bytes32 indexed id, address by);
    event Reclaimed(bytes32 indexed id, address indexed payer, uint256 amount);

    constructor(
        address token_,
        address arbiter_,
        address guardian_,
        address feeRecipient_,
        uint16 maxFeeBps_,
        uint32 arbiterDelay_
    ) {
        require(token_ != address(0) && arbiter_ != address(0) && guardian_ != address(0), "JobEscrow: zero address");
        require(feeRecipient_ != address(0) && feeRecipient_ != arbiter_, "JobEscrow: fee recipient");
        require(guardian_ != arbiter_, "JobEscrow: the guardian is not the arbiter");
        require(maxFeeBps_ <= 10_000, "JobEscrow: fee cap over 100 %");
        require(arbiterDelay_ >= 3600, "JobEscrow: arbiter delay under an hour");
        token = IUSDC(token_);
        arbiter = arbiter_;
        guardian = guardian_;
        feeRecipient = feeRecipient_;
        maxFeeBps = maxFeeBps_;
        arbiterDelay = arbiterDelay_;
    }

    // ----- money in -----

    /// A deposit's id: what the payer commits to (the EIP-3009 nonce of depositWithAuthorization).
    function depositId(address payer, bytes32 account, uint64 refundAfter, bytes32 salt) public pure returns (bytes32) {
        return keccak256(abi.encode(payer, account, refundAfter, salt));
    }

    /// By the payer, after approving this contract for `amount` on the token.
    function deposit(bytes32 account, uint256 amount, uint64 refundAfter, bytes32 salt) external returns (bytes32 id) {
        id = _open(msg.sender, account, amount, refundAfter, salt);
        require(token.transferFrom(msg.sender, address(this), amount), "JobEscrow: transfer failed");
    }

    /// By anyone (the marketplace pays the gas): the payer signed an EIP-3009 ReceiveWithAuthorization to this
    /// contract whose nonce is the deposit's id, so the signature binds the amount, the account and refundAfter.
    function depositWithAuthorization(
        address payer,
        bytes32 account,
        uint256 amount,
        uint64 refundAfter,
        bytes32 salt,
        uint256 validAfter,
        uint256 validBefore,
        bytes calldata signature
    ) external returns (bytes32 id) {
        id = _open(payer, account, amount, refundAfter, salt);
        token.receiveWithAuthorization(payer, address(this), amount, validAfter, validBefore, id, signature);
    }

    // ----- money out -----

    /// Pay `payee` when both the payer and the arbiter signed Release(id, claim, payee, amount, fee); each digest
    /// once. `claim` is keccak256 of the marketplace's claim id, so two equal shares to one wallet are two releases.
    function release(
        bytes32 id,
        bytes32 claim,
        address payee,
        uint256 amount,
        uint256 fee,
        bytes calldata payerSignature,
        bytes calldata arbiterSignature
    ) external {
        bytes32 digest = releaseDigest(id, claim, payee, amount, fee);
        _spendRelease(id, digest, payerSignature, arbiterSignature);
        _take(deposits[id], payee, amount, fee);
        emit Released(id, payee, amount, fee, true);
        _send(payee, amount);
        _send(feeRecipient, fee);
    }

    /// The arbiter sends `amount` back to the payer, at once.
    function refund(bytes32 id, uint256 amount) external {
        require(msg.sender == arbiter, "JobEscrow: only the arbiter");
        Deposit storage held = _existing(id);
        require(amount > 0 && amount <= held.remaining, "JobEscrow: amount");
        held.remaining -= amount;
        address payer = held.payer;
        emit Refunded(id, payer, amount);
        _send(payer, amount);
    }

    /// The arbiter proposes a payout without the payer's signature: anyone may execute it once arbiterDelay has
    /// passed, unless the guardian or the arbiter cancels it first. One pending per deposit.
    function propose(bytes32 id, address[] calldata payees, uint256[] calldata amounts, uint256 fee) external {
        require(msg.sender == arbiter, "JobEscrow: only the arbiter");
        Deposit storage held = _existing(id);
        require(_proposals[id].executableAt == 0, "JobEscrow: a proposal is pending");
        require(payees.length > 0 && payees.length == amounts.length && payees.length <= MAX_PAYEES, "JobEscrow: payees");
        _checkPayout(held, _total(payees, amounts), fee);
        uint64 executableAt = uint64(block.timestamp) + arbiterDelay;
        _proposals[id] = Proposal(payees, amounts, fee, executableAt);
        emit Proposed(id, payees, amounts, fee, executableAt);
    }

    /// Run a proposal whose delay has passed (anyone).
    function execute(bytes32 id) external {
        Proposal memory proposal = _proposals[id];
        require(proposal.executableAt != 0, "JobEscrow: no proposal");
        require(block.timestamp >= proposal.executableAt, "JobEscrow: too early");
        delete _proposals[id];
        Deposit storage held = _existing(id);
        uint256 total = _total(proposal.payees, proposal.amounts);
        _checkPayout(held, total, proposal.fee);
        held.remaining -= total + proposal.fee;
        for (uint256 i = 0; i < proposal.payees.length; i++) {
            emit Released(id, proposal.payees[i], proposal.amounts[i], i == 0 ? proposal.fee : 0, false);
        }
        for (uint256 i = 0; i < proposal.payees.length; i++) {
            _send(proposal.payees[i], proposal.amounts[i]);
        }
        _send(feeRecipient, proposal.fee);
    }

    /// The guardian (or the arbiter) drops a pending proposal before it runs.
    function cancel(bytes32 id) external {
        require(msg.sender == guardian || msg.sender == arbiter, "JobEscrow: only the guardian or the arbiter");
        require(_proposals[id].executableAt != 0, "JobEscrow: no proposal");
        delete _proposals[id];
        emit Cancelled(id, msg.sender);
    }

    /// Once refundAfter has passed, anyone sends what remains to the payer; a pending proposal is dropped.
    function reclaim(bytes32 id) external {
        Deposit storage held = _existing(id);
        require(block.timestamp >= held.refundAfter, "JobEscrow: too early");
        uint256 amount = held.remaining;
        require(amount > 0, "JobEscrow: nothing remains");
        held.remaining = 0;
        delete _proposals[id];
        address payer = held.payer;
        emit Reclaimed(id, payer, amount);
        _send(payer, amount);
    }

    // ----- views -----

    function proposals(bytes32 id)
        external
        view
        returns (address[] memory payees, uint256[] memory amounts, uint256 fee, uint64 executableAt)
    {
        Proposal storage proposal = _proposals[id];
        return (proposal.payees, proposal.amounts, proposal.fee, proposal.executableAt);
    }

    function domainSeparator() public view returns (bytes32) {
        return keccak256(
            abi.encode(DOMAIN_TYPEHASH, keccak256("JobEscrow"), keccak256("2"), block.chainid, address(this))
        );
    }

    /// The EIP-712 digest the payer and the arbiter both sign to release `amount` (and `fee`) of deposit `id` to
    /// `payee` for the claim whose id hashes to `claim`.
    function releaseDigest(bytes32 id, bytes32 claim, address payee, uint256 amount, uint256 fee)
        public
        view
        returns (bytes32)
    {
        bytes32 structHash = keccak256(abi.encode(RELEASE_TYPEHASH, id, claim, payee, amount, fee));
        return keccak256(abi.encodePacked("\x19\x01", domainSeparator(), structHash));
    }

    // ----- internals -----

    function _open(address payer, bytes32 account, uint256 amount, uint64 refundAfter, bytes32 salt)
        private
        returns (bytes32 id)
    {
        require(payer != address(0) && amount > 0, "JobEscrow: payer or amount");
        require(refundAfter > block.timestamp + arbiterDelay, "JobEscrow: refundAfter too soon");
        require(refundAfter <= block.timestamp + MAX_AHEAD, "JobEscrow: refundAfter too far");
        id = depositId(payer, account, refundAfter, salt);
        require(deposits[id].payer == address(0), "JobEscrow: deposit id used");
        deposits[id] = Deposit(payer, account, amount, refundAfter);
        emit Deposited(id, payer, account, amount, refundAfter);
    }

    /// A release's two signatures checked and its digest spent (a digest pays once).
    function _spendRelease(bytes32 id, bytes32 digest, bytes calldata payerSignature, bytes calldata arbiterSignature)
        private
    {
        Deposit storage held = _existing(id);
        require(!spentReleases[digest], "JobEscrow: release signature spent");
        require(_signedBy(held.payer, digest, payerSignature), "JobEscrow: not the payer's signature");
        require(_signedBy(arbiter, digest, arbiterSignature), "JobEscrow: not the arbiter's signature");
        spentReleases[digest] = true;
    }

    function _existing(bytes32 id) private view returns (Deposit storage held) {
        held = deposits[id];
        require(held.payer != address(0), "JobEscrow: no deposit");
    }

    function _total(address[] memory payees, uint256[] memory amounts) private view returns (uint256 total) {
        for (uint256 i = 0; i < payees.length; i++) {
            _checkPayee(payees[i]);
            total += amounts[i];
        }
    }

    function _checkPayee(address payee) private view {
        require(payee != address(0) && payee != address(this), "JobEscrow: payee");
    }

    /// amount + fee within what remains, and the fee within maxFeeBps of amount + fee.
    function _checkPayout(Deposit storage held, uint256 amount, uint256 fee) private view {
        require(amount + fee > 0 && amount + fee <= held.remaining, "JobEscrow: more than remains");
        require(fee * 10_000 <= (amount + fee) * maxFeeBps, "JobEscrow: fee over the cap");
    }

    function _take(Deposit storage held, address payee, uint256 amount, uint256 fee) private {
        _checkPayee(payee);
        _checkPayout(held, amount, fee);
        held.remaining -= amount + fee;
    }

    function _send(address to, uint256 amount) private {
        if (amount > 0) {
            require(token.transfer(to, amount), "JobEscrow: transfer failed");
        }
    }

    /// ECDSA (65 bytes, low s) for an account without code; EIP-1271 for a contract.
    function _signedBy(address signer, bytes32 digest, bytes calldata signature) private view returns (bool) {
        if (signer.code.length > 0) {
            (bool ok, bytes memory answer) =
                signer.staticcall(abi.encodeWithSelector(ERC1271_MAGIC, digest, signature));
            return ok && answer.length >= 32 && abi.decode(answer, (bytes4)) == ERC1271_MAGIC;
        }
        if (signature.length != 65) {
            return false;
        }
        bytes32 r = bytes32(signature[0:32]);
        bytes32 s = bytes32(signature[32:64]);
        uint8 v = uint8(signature[64]);
        if (v < 27) {
            v += 27;
        }
        if ((v != 27 && v != 28) || uint256(s) > HALF_CURVE_ORDER) {
            return false;
        }
        address recovered = ecrecover(digest, v, r, s);
        return recovered != address(0) && recovered == signer;
    }
}

/// What the contract uses of USDC: ERC-20 and EIP-3009's receiveWithAuthorization with a `bytes` signature.
interface IUSDC {
    function transfer(address to, uint256 value) external returns (bool);
    function transferFrom(address from, address to, uint256 value) external returns (bool);
    function receiveWithAuthorization(
        address from,
        address to,
        uint256 value,
        uint256 validAfter,
        uint256 validBefore,
        bytes32 nonce,
        bytes calldata signature
    ) external;
}
