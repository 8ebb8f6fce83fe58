// The forms' progressive enhancement (the pages' CSP runs no inline script): focus on the first refused field or
// on the refusal's words, and signing an on-chain funding with the browser's wallet (EIP-1193) when there is one.
(function () {
  'use strict';
  function focusFirstError() {
    var target = document.querySelector('[aria-invalid="true"]') || document.querySelector('.error[role="alert"]');
    if (target && document.activeElement !== target) {
      target.focus();
    }
  }

  function walletSigning() {
    var button = document.getElementById('wallet-sign');
    var provider = window.ethereum;
    if (!button || !provider || typeof provider.request !== 'function') {
      return;
    }
    button.hidden = false;
    button.addEventListener('click', function () {
      var typed = JSON.parse(document.getElementById('funding-typed-data').textContent);
      typed.message.txHash = document.getElementById('escrowTxHash').value.trim().toLowerCase();
      provider.request({ method: 'eth_requestAccounts' }).then(function (accounts) {
        return provider.request({ method: 'eth_signTypedData_v4', params: [accounts[0], JSON.stringify(typed)] });
      }).then(function (signature) {
        document.getElementById('escrowSignature').value = signature;
      }).catch(function (error) {
        button.textContent = 'The wallet did not sign: ' + (error && error.message ? error.message : error);
      });
    });
  }

  document.addEventListener('DOMContentLoaded', function () {
    focusFirstError();
    walletSigning();
  });
}());
