#!/usr/bin/env node
// `make contracts`: compile the project's Solidity with the solc from node_modules (package.json pins it) and
// write each artifact = {contractName, compiler, abi, bytecode, deployedBytecode}:
//   contracts/JobEscrow.sol -> contracts/JobEscrow.json   (the escrow of CONTRACT.md section 21)
//   fixtures/TestUSDC.sol   -> fixtures/TestUSDC.json     (a test USDC for the local chain)
// The output is deterministic: the same source and compiler give the same file (tests/test_escrow_contract.py
// rebuilds both into a temporary directory and compares). `node contracts/compile.js OUT_DIR` writes there.
'use strict';

const fs = require('fs');
const path = require('path');
const solc = require('solc');

const root = path.join(__dirname, '..');
const TARGETS = [
  { dir: 'contracts', source: 'JobEscrow.sol', contract: 'JobEscrow' },
  { dir: 'fixtures', source: 'TestUSDC.sol', contract: 'TestUSDC' },
];
const outDir = process.argv[2];

let failed = false;
for (const { dir, source, contract } of TARGETS) {
  const input = {
    language: 'Solidity',
    sources: { [source]: { content: fs.readFileSync(path.join(root, dir, source), 'utf8') } },
    settings: {
      optimizer: { enabled: true, runs: 200 },
      evmVersion: 'cancun',
      outputSelection: { [source]: { [contract]: ['abi', 'evm.bytecode.object', 'evm.deployedBytecode.object'] } },
    },
  };
  const output = JSON.parse(solc.compile(JSON.stringify(input)));
  const problems = output.errors || [];
  for (const problem of problems) {
    console.error(problem.formattedMessage);
  }
  if (problems.some((problem) => problem.severity === 'error')) {
    failed = true;
    continue;
  }
  const compiled = output.contracts[source][contract];
  const artifact = {
    contractName: contract,
    compiler: `solc ${solc.version()} optimizer runs=200 evm=cancun`,
    abi: compiled.abi,
    bytecode: '0x' + compiled.evm.bytecode.object,
    deployedBytecode: '0x' + compiled.evm.deployedBytecode.object,
  };
  const target = path.join(outDir || path.join(root, dir), contract + '.json');
  fs.writeFileSync(target, JSON.stringify(artifact, null, 2) + '\n');
  console.log(`wrote ${target} (${(artifact.deployedBytecode.length - 2) / 2} bytes of runtime code)`);
}
process.exit(failed ? 1 : 0);
